"""hvdtrain.fit, the Python API: the examples run at two ranks; settings and arrays are checked first."""
import json

import numpy as np
import pytest

from hvdtrain.api import as_dataset, resolve_config
from hvdtrain.config import Config
from hvdtrain.errors import HvdtrainError
from tests.helpers.kerases import needs_keras3
from tests.helpers.ranks import run_ranks


def logged(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_custom_task_example_trains_a_model_function_with_a_callable_metric_at_two_ranks(tmp_path):
    result = run_ranks(2, ["examples/custom_task.py", "--train", "6000", "--epochs", "1", "--log-dir", str(tmp_path)])
    assert "model: small_cnn (user model)" in result.stdout
    assert "task:  loss binary_crossentropy; metrics accuracy, exact_match" in result.stdout
    [epoch] = logged(tmp_path)
    assert epoch["world_size"] == 2 and epoch["train_examples"] == 6000
    # Tag accuracy above always answering "no" ((0.7 + 0.6 + 0.9) / 3 = 0.73), printed once, by rank 0
    # (every rank holds the same global history).
    assert epoch["test_accuracy"] > 0.8 and 0 < epoch["test_exact_match"] <= epoch["test_accuracy"]
    lines = [line for line in result.stdout.splitlines() if "all tags right" in line]
    assert len(lines) == 1 and lines[0].startswith("[0]")


@needs_keras3
def test_keras3_example_trains_keras_3s_mobilenet_v2_at_two_ranks(tmp_path):
    """README's Keras 3 quick start as a script: `import keras`, keras.applications' MobileNetV2
    converted, the user's AdamW and a Keras 3 EarlyStopping."""
    result = run_ranks(2, ["examples/keras3_mobilenet.py", "--train", "3000", "--test", "1000", "--epochs", "2",
                           "--log-dir", str(tmp_path)], timeout=600)
    assert "model: build (user model)" in result.stdout and "Keras BatchNormalization" not in result.stderr
    history = logged(tmp_path)
    assert [e["world_size"] for e in history] == [2, 2] and history[-1]["train_loss"] < history[0]["train_loss"]
    # Training learns (chance is 0.1); 94 steps are too few for MobileNetV2's evaluation with moving
    # statistics to follow, so the test accuracy is not asked here.
    assert history[-1]["train_accuracy"] > 0.3
    assert len([line for line in result.stdout.splitlines() if "test accuracy" in line]) == 2


def test_segmentation_example_trains_the_unet_at_local_batch_2(tmp_path):
    """The U-Net of examples/segmentation.py at 2 ranks x 2 images, one epoch of 1,000 images, learns
    more than the background (0.18 here). Whether synchronized BatchNorm beats per-rank BatchNorm
    there is a measurement over seeds: benchmarks/segmentation_bn.py."""
    result = run_ranks(2, ["examples/segmentation.py", "--train", "1000", "--epochs", "1", "--log-dir",
                           str(tmp_path / "sync")])
    assert "11 classes per pixel (28x28 label maps)" in result.stdout
    [epoch] = logged(tmp_path / "sync")
    assert (tmp_path / "sync" / "config.yaml").read_text().count("name: unet") == 1
    # Predicting background everywhere scores about 0.56 / 11 = 0.05.
    assert epoch["test_mean_iou"] > 0.1, epoch


def test_settings_go_over_the_config_and_are_checked_by_name():
    config = resolve_config({"optim": {"base_lr": 0.1}, "epochs": 3}, {"epochs": 5, "task": {"loss": "mse"}})
    assert (config.epochs, config.optim.base_lr, config.task.loss, config.task.metric_names) == (5, 0.1, "mse", ())
    assert resolve_config(Config(batch_size=16), {}).batch_size == 16
    with pytest.raises(HvdtrainError, match=r"hvdtrain.fit\(...\): unknown key 'optim.base_rate'; did you mean 'base_lr'"):
        resolve_config(None, {"optim": {"base_rate": 0.1}})
    with pytest.raises(HvdtrainError, match="--metrics must be comma-separated names among"):
        resolve_config(None, {"task": {"metrics": "accuracy,f1"}})


def test_arrays_are_validated_as_the_loss_takes_their_labels():
    x = np.zeros((4, 8, 8), np.uint8)
    dense = as_dataset((x, np.eye(8, dtype=np.int64)[None].repeat(4, 0), x, np.zeros((4, 8, 8), np.int64)), "classes")
    assert dense.input_shape == (8, 8, 1) and dense.label_shape == (8, 8) and dense.num_classes == 2
    targets = as_dataset((x, np.ones((4, 3)), x, np.ones((4, 3))), None)
    assert targets.labels == "targets" and targets.num_classes == 3
    cifar_layout = as_dataset((x, np.arange(4)[:, None] % 2, x, np.arange(4)[:, None] % 2), "classes")
    assert cifar_layout.label_shape == () and cifar_layout.num_classes == 2  # keras.datasets' (n, 1) classes
    scalar = as_dataset((x, np.arange(4.0), x, np.arange(4.0)), "targets")
    assert scalar.label_shape == (1,) and scalar.num_classes == 1  # for (batch, 1) outputs
    with pytest.raises(HvdtrainError, match="must be integer class labels, got dtype float64 holding whole numbers"):
        as_dataset((x, np.ones(4), x, np.ones(4)), "classes")
    with pytest.raises(HvdtrainError, match=r"takes \(x_train, y_train, x_test, y_test\) arrays, .* got tuple of 2"):
        as_dataset((x, x), None)


def test_streamed_data_takes_two_datasets_or_a_function_and_refuses_one_dataset():
    import tensorflow as tf

    from hvdtrain.api import streamed_data
    from hvdtrain.data.function import check_structure, datasets_function

    train = tf.data.Dataset.from_tensor_slices((np.zeros((6, 4, 4, 1), np.uint8), np.arange(6) % 2))
    assert streamed_data((train, train))[1:] == ("hvdtrain.fit(data=(train, test))", "tf.data:(train, test)")
    fn, where, name = streamed_data(test_streamed_data_takes_two_datasets_or_a_function_and_refuses_one_dataset)
    assert name.startswith("tests.test_api:test_streamed") and where.startswith("hvdtrain.fit(data=test_streamed")
    assert streamed_data((np.zeros(2),) * 4) is None  # arrays: in memory
    with pytest.raises(HvdtrainError, match="got one tf.data.Dataset; pass \\(train, test\\)"):
        streamed_data(train)
    # Every rank shuffles the training set alike for a (seed, epoch), and another epoch otherwise;
    # the test set keeps its order.
    fn = datasets_function(train, train, shuffle_buffer=100)
    order = [[int(y) for _, y in fn("train", rank, 2, 0, epoch)] for rank, epoch in ((0, 0), (1, 0), (0, 1))]
    assert order[0] == order[1] and sorted(order[0]) == sorted(order[2])
    assert [int(y) for _, y in fn("test", 0, 2, 0, 0)] == [0, 1, 0, 1, 0, 1]
    with pytest.raises(HvdtrainError, match="the dataset is batched"):
        check_structure(train.batch(2), "hvdtrain.fit(data=(train, test))", "train")
