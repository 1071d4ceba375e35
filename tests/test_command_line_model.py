"""A Keras model object from the command line (hvdtrain.command_line_model): ``--model pkg.mod:fn``
with ``fn()`` returning a compiled model trains by Keras' default train_step at 2 ranks on local
batch 8 as one process on 16 (Fashion-MNIST's first 101 images, from an NPZ file: the last step
3 + 2), weights to 1e-5 and metrics to the printed digit; a data function of dict examples with
token ids trains it too; a function that returns no model, and a streamed format this path does
not read, are one error each."""
import numpy as np
import pytest

import hvdtrain
from hvdtrain.data.in_memory import load_idx_dir
from tests.helpers.oracle import assert_same_weights
from tests.helpers.runs import hvdtrain as run_hvdtrain
from tests.helpers.runs import metrics

MODELS = "tests.helpers.models"


def _fashion_npz(path):
    fashion = load_idx_dir("/usr/share/datasets/fashion-mnist")
    np.savez(path, x_train=fashion.x_train[:101], y_train=fashion.y_train[:101], x_test=fashion.x_test[:40],
             y_test=fashion.y_test[:40])
    return path


def _weights(run_dir):
    return {str(i): w for i, w in enumerate(hvdtrain.load_model(str(run_dir / "model.keras")).get_weights())}


def test_a_compiled_model_object_at_two_ranks_equals_one_process_on_the_global_batch(tmp_path):
    npz = _fashion_npz(tmp_path / "fashion101.npz")
    common = ["--model", f"{MODELS}:compiled_mlp", "--dataset", "npz", "--data-dir", str(npz), "--epochs", "2"]
    ranks = run_hvdtrain(2, [*common, "--batch-size", "8", "--log-dir", str(tmp_path / "np2")])
    run_hvdtrain(1, [*common, "--batch-size", "16", "--log-dir", str(tmp_path / "np1")], launcher="single")
    assert "step:  Keras' default train_step; 1 optimizer(s)" in ranks.stdout
    assert "x uint8 (28, 28, 1); y " in ranks.stdout and " ex/s " in ranks.stdout
    assert_same_weights(_weights(tmp_path / "np2"), _weights(tmp_path / "np1"), prefix="")
    ours, alone = metrics(tmp_path / "np2")[-1], metrics(tmp_path / "np1")[-1]
    for key in ("train_loss", "train_accuracy", "test_loss", "test_accuracy"):
        assert ours[key] == pytest.approx(alone[key], rel=1e-5, abs=1e-6), key


def test_a_data_function_of_dict_examples_trains_a_model_object(tmp_path):
    result = run_hvdtrain(2, ["--model", f"{MODELS}:token_classifier", "--dataset", "function",
                              "--data", f"{MODELS}:token_examples", "--batch-size", "8", "--epochs", "2",
                              "--log-dir", str(tmp_path)])
    assert "101 train / 40 test examples, streamed by tf.data; x['ids'] int32 (12); y int32 ()" in result.stdout
    history = metrics(tmp_path)
    assert [m["train_examples"] for m in history] == [101, 101]
    assert 0.0 <= history[-1]["test_accuracy"] <= 1.0


@pytest.mark.parametrize("args, message", [
    (["--model", f"{MODELS}:returns_a_string"],
     f"--model '{MODELS}:returns_a_string': the function returned str, not a Keras model"),
    (["--model", f"{MODELS}:compiled_mlp", "--dataset", "tfrecord", "--data-dir", "/nonexistent"],
     "--dataset tfrecord with a Keras model object"),
    (["--model", f"{MODELS}:uncompiled_mlp"],
     f"--model '{MODELS}:uncompiled_mlp': the model is not compiled: compile it in your code"),
])
def test_what_this_path_cannot_take_is_one_error(tmp_path, args, message):
    result = run_hvdtrain(1, [*args, "--log-dir", str(tmp_path)], launcher="single", check=False)
    assert result.returncode == 2
    assert f"hvdtrain: error: {message}" in result.stderr
    assert not (tmp_path / "checkpoints").exists()


def test_only_a_model_object_or_a_function_of_no_parameters_is_one():
    import keras

    from hvdtrain.command_line_model import _makes_a_model

    def build(input_shape=(28, 28, 1), num_classes=10):
        return None

    def build_kwargs(**kwargs):
        return None

    def make():
        return None

    assert _makes_a_model(make) and _makes_a_model(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))
    assert not any(_makes_a_model(f) for f in (build, build_kwargs, keras.Sequential, print))
