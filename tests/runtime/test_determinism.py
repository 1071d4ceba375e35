"""The same command twice at world size 3 gives bit-identical metrics and weights, in memory and
streamed, with synchronized BatchNorm and tensor fusion on (hvdtrain.exchange's fixed buckets);
``--deterministic`` adds TensorFlow's deterministic ops."""
import json

import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.config import DEFAULT_DATA_DIR
from hvdtrain.data.in_memory import load_idx_dir
from hvdtrain.tools.make_image_folder import write_image_folder
from tests.helpers.ranks import run_ranks

TIMING = ("images_per_sec", "epoch_time_s")


def _run(tmp_path, name, data_args):
    log_dir = tmp_path / name
    run_ranks(3, ["-m", "hvdtrain", *data_args, "--epochs", "2", "--batch-size", "50", "--no-progress",
                  "--log-dir", str(log_dir)], timeout=600)
    return log_dir


def _metrics(log_dir):
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def _weights(log_dir):
    [latest] = sorted((log_dir / "checkpoints").glob("ckpt-*"))[-1:]
    reader = tf.train.load_checkpoint(str(latest / "state"))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


@pytest.fixture(scope="module")
def fashion_1500(tmp_path_factory):
    """1,500 Fashion-MNIST training images (300 test) as an image folder and as an NPZ file."""
    d = load_idx_dir(DEFAULT_DATA_DIR)
    root = tmp_path_factory.mktemp("fashion")
    x, y, xt, yt = d.x_train[:1500], d.y_train[:1500], d.x_test[:300], d.y_test[:300]
    np.savez(root / "data.npz", x_train=x, y_train=y, x_test=xt, y_test=yt)
    return {"folder": str(write_image_folder(str(root / "images"), x, y, xt, yt, fmt="png")),
            "npz": str(root / "data.npz")}


@pytest.mark.parametrize("kind", ["in memory", "streamed"])
def test_the_same_command_twice_at_three_ranks_is_bit_identical(tmp_path, kind, fashion_1500):
    data = (["--dataset", "npz", "--data-dir", fashion_1500["npz"]] if kind == "in memory" else
            ["--dataset", "folder", "--data-dir", fashion_1500["folder"], "--augment", "flip"])
    first, second = _run(tmp_path, "first", data), _run(tmp_path, "second", data)
    assert _metrics(first) == _metrics(second)
    ours, theirs = _weights(first), _weights(second)
    assert ours.keys() == theirs.keys() and len(ours) > 10
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)


@pytest.mark.parametrize("env, message", [
    ({"HOROVOD_DISABLE_GROUP_FUSION": "0"}, "--deterministic keeps each gradient bucket in a fused buffer of its "
                                            "own, but HOROVOD_DISABLE_GROUP_FUSION=0 lets Horovod fuse them by "
                                            "timing: unset it"),
    ({"HOROVOD_AUTOTUNE": "1"}, "--deterministic needs the same fused buffers every step, but HOROVOD_AUTOTUNE=1 "
                                "changes Horovod's fusion threshold as it tunes: unset it"),
], ids=["group-fusion", "autotune"])
def test_fusion_by_timing_is_refused_with_deterministic(tmp_path, env, message):
    result = run_ranks(3, ["-m", "hvdtrain", "--dataset", "synthetic", "--epochs", "1", "--deterministic",
                           "--log-dir", str(tmp_path / "refused")], env=env, timeout=300, check=False)
    assert result.returncode != 0
    assert message in result.stderr
