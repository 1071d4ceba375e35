"""Streamed data with real ranks (np=2 over Gloo): an image folder trains exactly as the same images
in memory; TFRecord shards and a data function train as well; a resumed run continues the same
streams; a file that fails mid-epoch stops every rank with one error naming it.

The folder and the TFRecord files are made here from Debian's Fashion-MNIST copy (no download).
Start-up errors (empty class folders, truncated TFRecords...) are in tests/test_bad_input.py.
"""
import json
import os
import re
import shutil

import numpy as np
import pytest

from hvdtrain.data.stream import PIPELINE_NICE, behind_the_step, untuned
from hvdtrain.runtime.placement import thread_ids
from hvdtrain.tools.make_image_folder import folder_order, write_image_folder
from tests.helpers.ranks import processes_naming, run_ranks

COMMON = ["--epochs", "1", "--threads", "1", "--no-progress", "--seed", "0"]


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def train(args, run_dir, check=True):
    return run_ranks(2, ["-m", "hvdtrain", *COMMON, *args, "--log-dir", str(run_dir)], timeout=600, check=check)


@pytest.fixture(scope="module")
def fashion_files(tmp_path_factory):
    """The first 12,000 training and 2,000 test images of Fashion-MNIST as a PNG folder, the same
    in the folder's order as an NPZ file, and as TFRecord shards made from a JPEG folder of them."""
    from hvdtrain.config import DEFAULT_DATA_DIR
    from hvdtrain.data.in_memory import load_idx_dir
    from hvdtrain.tools import make_tfrecords

    if not os.path.isdir(DEFAULT_DATA_DIR):
        pytest.skip("Debian's dataset-fashion-mnist is not installed")
    full = load_idx_dir(DEFAULT_DATA_DIR)
    x, y, x_test, y_test = full.x_train[:12000], full.y_train[:12000], full.x_test[:2000], full.y_test[:2000]
    root = tmp_path_factory.mktemp("fashion")
    folder = write_image_folder(root / "folder", x, y, x_test, y_test, fmt="png")
    order, test_order = folder_order(y), folder_order(y_test)
    np.savez(root / "in-memory.npz", x_train=x[order, ..., 0], y_train=y[order], x_test=x_test[test_order, ..., 0],
             y_test=y_test[test_order])
    jpeg = write_image_folder(root / "jpeg", x, y, x_test, y_test, fmt="jpg")
    assert make_tfrecords.main(["--folder", jpeg, "--out", str(root / "records"), "--shards", "8"]) == 0
    return {"folder": folder, "npz": str(root / "in-memory.npz"), "tfrecord": str(root / "records")}


@pytest.fixture(scope="module")
def in_memory_metrics(fashion_files, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("in_memory")
    train(["--dataset", "npz", "--data-dir", fashion_files["npz"]], run_dir)
    return metrics(run_dir)[-1]


def test_the_pipelines_threads_run_behind_the_step_and_its_elements_and_errors_are_kept():
    """Every thread tf.data starts for the pipeline runs at PIPELINE_NICE, the caller at its own;
    the elements are those of iterating the dataset, and its errors reach the caller."""
    import threading

    import tensorflow as tf

    def nice(tid):
        return os.getpriority(os.PRIO_PROCESS, tid)

    caller = nice(threading.get_native_id())
    list(tf.data.Dataset.range(2).map(lambda x: x, num_parallel_calls=2))  # TensorFlow's own threads, started
    before = thread_ids()
    data = untuned(tf.data.Dataset.range(1000).map(lambda x: (x * 2,), num_parallel_calls=2).batch(10).prefetch(2), 2)
    got, started = [], {}
    for (batch,) in behind_the_step(data):
        got.append(batch.numpy())
        if len(got) == 50:  # the iterator's threads are alive
            started = {tid: nice(tid) for tid in thread_ids() - before}
    assert np.array_equal(np.concatenate(got), np.arange(1000) * 2)
    assert len(started) >= 3 and set(started.values()) == {PIPELINE_NICE}, started  # pool, map, prefetch
    assert nice(threading.get_native_id()) == caller
    for (batch,) in behind_the_step(data, nice=caller):  # --pipeline-nice 0: the step's priority
        started = {tid: nice(tid) for tid in thread_ids() - before}
        break
    assert len(started) >= 3 and set(started.values()) == {caller}, started
    assert list(behind_the_step(tf.data.Dataset.range(0).map(lambda x: (x,)))) == []

    def fails_at_5(x):
        tf.debugging.assert_less(x, tf.constant(5, tf.int64), message="example 5 is bad")
        return (x,)

    for first in (0, 5):
        with pytest.raises(tf.errors.InvalidArgumentError, match="example 5 is bad"):
            list(behind_the_step(tf.data.Dataset.range(first, 8).map(fails_at_5)))


def test_image_folder_trains_exactly_as_in_memory(fashion_files, in_memory_metrics, tmp_path):
    """Each step each rank decodes the examples the in-memory path gathers (PNG: the same pixels),
    so one epoch ends with the same losses and accuracies."""
    result = train(["--dataset", "folder", "--data-dir", fashion_files["folder"]], tmp_path)
    assert "streamed by tf.data" in result.stdout
    streamed = metrics(tmp_path)[-1]
    assert streamed["train_examples"] == in_memory_metrics["train_examples"] == 12000
    for key in ("train_loss", "test_loss", "train_accuracy", "test_accuracy"):
        assert streamed[key] == pytest.approx(in_memory_metrics[key], rel=1e-5), key


def test_tfrecords_of_jpegs_reach_the_in_memory_accuracy(fashion_files, tmp_path):
    """TFRecord shards of JPEGs (8 files, each rank a contiguous range of the shuffled stream)
    reach the test accuracy of the same images in memory within 0.5 points. The streams' orders
    differ, so the MLP trains 5 epochs: there, other seeds move either within 0.5 points."""
    mlp = ["--model", "tests.helpers.models:mlp", "--epochs", "5"]
    train(["--dataset", "tfrecord", "--data-dir", fashion_files["tfrecord"], *mlp], tmp_path / "streamed")
    train(["--dataset", "npz", "--data-dir", fashion_files["npz"], *mlp], tmp_path / "in_memory")
    streamed, in_memory = metrics(tmp_path / "streamed")[-1], metrics(tmp_path / "in_memory")[-1]
    assert streamed["train_examples"] == 12000
    assert abs(streamed["test_accuracy"] - in_memory["test_accuracy"]) <= 0.005, (streamed, in_memory)
    assert os.path.isfile(os.path.join(fashion_files["tfrecord"], "hvdtrain-index.json")), "the index is cached"


def test_data_function_trains(tmp_path):
    """``--data tests.helpers.datafns:fashion``: 6,000 examples of the user's own pipeline, each once per epoch."""
    result = train(["--data", "tests.helpers.datafns:fashion", "--model", "tests.helpers.models:mlp"], tmp_path)
    assert "data:  data:tests.helpers.datafns:fashion: 6,000 train / 1,000 test, 28x28x1, 10 classes" in result.stdout
    last = metrics(tmp_path)[-1]
    assert last["train_examples"] == 6000 and last["test_accuracy"] > 0.7


def test_resumed_tfrecord_run_continues_the_same_stream(fashion_files, tmp_path):
    """Two epochs straight, or one and then --resume for the second: the same final metrics (each
    epoch's stream is a function of the seed and the epoch)."""
    data = ["--dataset", "tfrecord", "--data-dir", fashion_files["tfrecord"], "--model", "tests.helpers.models:mlp"]
    train([*data, "--epochs", "2"], tmp_path / "straight")
    train(data, tmp_path / "resumed")
    train([*data, "--epochs", "2", "--resume"], tmp_path / "resumed")
    straight, resumed = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert len(resumed) == 2
    for key in ("train_loss", "test_loss", "test_accuracy"):
        assert resumed[1][key] == pytest.approx(straight[1][key], rel=1e-6), key


@pytest.mark.parametrize("case", ["undecodable JPEG", "image of another size", "a data function that shrinks"])
def test_failure_mid_epoch_stops_every_rank_naming_the_cause(fashion_files, tmp_path, case):
    if case == "a data function that shrinks":
        args = ["--data", "tests.helpers.datafns:shrinks", "--model", "tests.helpers.models:mlp", "--epochs", "2"]
        expected = "were planned: the data gave fewer examples this epoch than the 6,000 counted at the start"
    else:
        folder = tmp_path / "folder"
        shutil.copytree(fashion_files["folder"], folder)
        victim = sorted((folder / "train" / "class07").iterdir())[100]
        if case == "undecodable JPEG":
            victim.write_bytes(b"\xff\xd8\xff\xe0 truncated")
        else:
            import tensorflow as tf

            victim.write_bytes(tf.io.encode_png(np.zeros((32, 32, 1), np.uint8)).numpy())
        args = ["--dataset", "folder", "--data-dir", str(folder), "--model", "tests.helpers.models:mlp"]
        expected = f"image {victim}: "
    result = train(args, tmp_path / "run", check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert output.count(expected) == 1, output[-3000:]
    assert not re.search(r"\[\d+\]<stderr>:Traceback", output), output[-3000:]
    # Every rank has ended (on its own, or by the launcher, whose report of the latter is racy).
    assert processes_naming(str(tmp_path / "run")) == [], output[-3000:]
    checkpoints = tmp_path / "run" / "checkpoints"
    if case == "a data function that shrinks":  # failed in epoch 2: epoch 1's checkpoint is whole
        assert [p.name for p in checkpoints.iterdir() if p.name.startswith("ckpt-")] == ["ckpt-000024"]
    else:
        assert not checkpoints.exists() or not any(p.name.startswith("ckpt-") for p in checkpoints.iterdir())
