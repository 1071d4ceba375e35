"""Bad input, table-driven, with real ranks: one clear message, every rank exits non-zero, promptly,
and nothing already on disk is touched.

Each case prepares its files under ``tmp_path`` and gives the arguments and the message expected on
stderr exactly once (printed by rank 0 or by the rank that found the problem).
"""
import hashlib
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from typing import List

import numpy as np
import pytest

from tests.helpers.ranks import command, launch, rank_env
from tests.helpers.idx_files import corrupt, make_idx_dir, save_npz, write_idx

MLP = ["--model", "tests.helpers.models:mlp"]
KERAS_3 = int(importlib.metadata.version("keras").split(".")[0]) >= 3
SYNTHETIC = ["--dataset", "synthetic"]


def idx(tmp, how):
    root = tmp / "idx"
    root.mkdir()
    make_idx_dir(root, labels=np.arange(19) % 3 if how == "count" else None)
    if how == "dims":  # a 2-D file where the 3-D images belong
        write_idx(root / "train-images-idx3-ubyte", np.zeros((20, 20), np.uint8))
    elif how in ("magic", "truncated"):
        corrupt(root / "train-images-idx3-ubyte", how)
    return ["--dataset", "idx", "--data-dir", str(root), *MLP]


def npz(tmp, **overrides):
    return ["--dataset", "npz", "--data-dir", save_npz(tmp / "data.npz", **overrides), *MLP]


def per_rank_data(tmp):
    """Rank 0 and rank 1 read NPZ files of the same shapes but different labels."""
    save_npz(tmp / "data0.npz")
    save_npz(tmp / "data1.npz", y_train=(np.arange(12) + 1) % 4)
    return ["-m", "tests.workers.per_rank_args", "--dataset", "npz", "--data-dir", str(tmp / "data{rank}.npz"), *MLP]


def blocked(tmp):
    """A path under a regular file: no directory can be made there."""
    (tmp / "a-file").write_text("not a directory")
    return str(tmp / "a-file" / "sub")


def a_file(tmp):
    """A regular file where a directory is expected."""
    (tmp / "a-file").write_text("not a directory")
    return str(tmp / "a-file")


def run_file(tmp, text):
    (tmp / "run.yaml").write_text(text)
    return [*SYNTHETIC, *MLP, "--config", str(tmp / "run.yaml")]


def resume_from(tmp, trained_run, model="tests.helpers.models:mlp", truncate=False, step_in_epoch=None):
    run_dir = tmp / "resumed"
    shutil.copytree(trained_run, run_dir)
    if step_in_epoch is not None:  # as if written mid-epoch (--checkpoint-every)
        meta_file = sorted((run_dir / "checkpoints").iterdir())[-1] / "meta.json"
        meta = json.loads(meta_file.read_text())
        meta.update(epoch=0, step_in_epoch=step_in_epoch, epoch_sums=[0.0, 0.0, 0.0, 0.0])
        meta_file.write_text(json.dumps(meta))
    if truncate:
        ckpt = sorted((run_dir / "checkpoints").iterdir())[-1]
        data = next(p for p in ckpt.iterdir() if p.name.startswith("state.data"))
        with open(data, "r+b") as f:
            f.truncate(10)
    return [*SYNTHETIC, "--model", model, "--batch-size", "64", "--epochs", "2", "--resume", "--log-dir", str(run_dir)]


def image_folder(tmp, how):
    """A small PNG folder, with an empty class folder or without its test split."""
    from hvdtrain.data.in_memory import make_synthetic
    from hvdtrain.tools.make_image_folder import write_image_folder

    d = make_synthetic(num_train=24, num_test=6, image_shape=(6, 6, 1), num_classes=3, seed=1)
    root = write_image_folder(tmp / "images", d.x_train, d.y_train, d.x_test, d.y_test, fmt="png")
    if how == "empty class":
        (tmp / "images" / "train" / "class03").mkdir()
    elif how == "no test split":
        shutil.rmtree(tmp / "images" / "test")
    return ["--dataset", "folder", "--data-dir", root, *MLP]


def records(tmp, how):
    """TFRecord shards of 9 and 7 records, one truncated or one record without its label."""
    from tests.helpers.streams import write_records

    (tmp / "records").mkdir()
    train = write_records(tmp / "records", [9, 7])
    write_records(tmp / "records", [3], prefix="test")
    if how == "truncated":
        with open(train[1], "r+b") as f:
            f.truncate(os.path.getsize(train[1]) - 9)
    elif how == "no label":
        import tensorflow as tf

        with tf.io.TFRecordWriter(train[0]) as writer:
            writer.write(tf.train.Example().SerializeToString())
    return ["--dataset", "tfrecord", "--data-dir", str(tmp / "records"), *MLP]


def resume_stuck_re_save(tmp, trained_run):
    """A re-save interrupted between its renames left ``ckpt-N.old-<pid>``, and a regular file now
    sits at ``ckpt-N``: the checkpoint cannot be put back, and must not be lost."""
    args = resume_from(tmp, trained_run)
    ckpt = sorted((tmp / "resumed" / "checkpoints").iterdir())[-1]
    ckpt.rename(f"{ckpt}.old-4242")
    ckpt.write_text("not a checkpoint")
    return args


# (case id, make the arguments from (tmp_path, a copy-before-use trained run: conftest's trained_mlp_run),
# the message printed once)
CASES = [
    ("missing data directory", lambda t, r: ["--data-dir", str(t / "nowhere"), *MLP], "does not exist"),
    ("IDX bad magic number", lambda t, r: idx(t, "magic"), "bad magic number"),
    ("IDX truncated", lambda t, r: idx(t, "truncated"), "bytes (truncated)"),
    ("IDX wrong dimensions", lambda t, r: idx(t, "dims"), "images must have 3 dimensions"),
    ("IDX image/label count mismatch", lambda t, r: idx(t, "count"), "20 images but 19 labels"),
    ("labels out of range", lambda t, r: npz(t, y_train=np.arange(12) - 1),
     r"labels must be in [0, 11), found range [-1, 10]: -1 at y_train[0], 0-based"),
    ("a corrupt label adds classes", lambda t, r: npz(t, y_train=np.r_[np.arange(11) % 4, 200]),
     "the labels go up to 200 (at y_train[11], 0-based), but no training example has class 4, 5, 6, 7, 8 and 191 more"),
    ("NPZ missing key", lambda t, r: npz(t, y_test=None), "missing key(s) ['y_test']"),
    ("NPZ wrong dtype", lambda t, r: npz(t, y_train=np.arange(12, dtype=np.float32)), "y_train must be integer class labels, got dtype float32 holding whole numbers: cast it to an integer dtype"),
    ("NPZ wrong shape", lambda t, r: npz(t, x_train=np.zeros((12, 6), np.uint8)), "x_train must have shape (n, H, W[, C])"),
    ("NPZ object arrays", lambda t, r: npz(t, x_train=np.array([object()] * 12, dtype=object)),
     "cannot load without unpickling"),
    ("empty dataset", lambda t, r: npz(t, x_train=np.zeros((0, 6, 6), np.uint8), y_train=np.zeros(0, np.int64)),
     "empty dataset"),
    ("fewer examples than world size x batch", lambda t, r: npz(t) + ["--batch-size", "8"],
     "12 training examples are fewer than one global batch (2 ranks x --batch-size 8)"),
    ("batch size 0", lambda t, r: ["--batch-size", "0"], "--batch-size must be an integer >= 1, got 0"),
    ("batch size not a number", lambda t, r: ["--batch-size", "ten"], "argument --batch-size: invalid int value: 'ten'"),
    ("negative epochs", lambda t, r: ["--epochs", "-1"], "--epochs must be an integer >= 0, got -1"),
    ("non-finite learning rate", lambda t, r: ["--lr", "nan"], "--lr must be finite and > 0, got nan"),
    ("unknown model name", lambda t, r: [*SYNTHETIC, "--model", "vgg"], "--model 'vgg': unknown model"),
    ("a model whose outputs do not fit per-pixel labels",
     lambda t, r: npz(t, y_train=np.arange(12 * 36).reshape(12, 6, 6) % 4, y_test=np.arange(5 * 36).reshape(5, 6, 6) % 4)
     + ["--batch-size", "4"],
     "--model 'tests.helpers.models:mlp': the model outputs shape (2, 4) for 2 images, expected (2, 6, 6, 4) logits of the 4 "
     "classes for labels of shape (6, 6) per image"),
    ("a metric that does not fit the labels", lambda t, r: [*SYNTHETIC, *MLP, "--loss", "mse", "--metrics", "mean_iou"],
     "--metrics mean_iou: needs class-index labels, but the loss mse takes targets"),
    ("unknown metric", lambda t, r: ["--metrics", "accuracy,f1"],
     "--metrics must be comma-separated names among ('accuracy', 'top5', 'mean_iou'), got 'accuracy,f1'"),
    ("targets from a stream of classes", lambda t, r: ["--data", "tests.helpers.datafns:fashion", "--loss", "mse", *MLP],
     "--loss mse takes targets as labels, but"),
    ("XLA with synchronized BatchNorm", lambda t, r: [*SYNTHETIC, "--xla"],
     "--xla compiles the forward and backward pass, which cannot hold the allreduce of synchronized BatchNorm"),
    ("model module missing", lambda t, r: [*SYNTHETIC, "--model", "no_such_module:fn"],
     "cannot import module 'no_such_module'"),
    ("model module fails at import", lambda t, r: [*SYNTHETIC, "--model", "tests.helpers.broken_models:model"],
     "cannot import module 'tests.helpers.broken_models' (RuntimeError: this module fails at import (test))"),
    ("model function missing", lambda t, r: [*SYNTHETIC, "--model", "tests.helpers.models:no_such_fn"],
     "module 'tests.helpers.models' has no function 'no_such_fn'"),
    ("model function returns no model", lambda t, r: [*SYNTHETIC, "--model", "tests.helpers.models:not_a_model"],
     "returned str, not a Keras model"),
    ("model function calls sys.exit(0)", lambda t, r: [*SYNTHETIC, "--model", "tests.helpers.models:exits"],
     "--model 'tests.helpers.models:exits': the function raised SystemExit: 0"),
    ("log directory under a file", lambda t, r: [*SYNTHETIC, *MLP, "--log-dir", blocked(t)],
     "a-file is a file, not a directory (--log-dir)"),
    ("log directory is a file", lambda t, r: [*SYNTHETIC, *MLP, "--log-dir", a_file(t)],
     "a-file is a file, not a directory (--log-dir)"),
    ("IDX --data-dir is a file", lambda t, r: ["--data-dir", a_file(t), *MLP],
     "is a file; --dataset idx (the default) reads a directory of IDX files (--dataset npz reads one .npz file)"),
    ("resume from a log directory that is a file", lambda t, r: [*SYNTHETIC, *MLP, "--resume", "--log-dir", a_file(t)],
     "is a file, not a directory (check --log-dir/--checkpoint-dir)"),
    ("NPZ path is a directory", lambda t, r: ["--dataset", "npz", "--data-dir", str(t), *MLP],
     "is a directory; --dataset npz reads one .npz file (--dataset idx reads a directory)"),
    ("checkpoint directory under a file", lambda t, r: [*SYNTHETIC, *MLP, "--log-dir", str(t / "new-run"),
                                                        "--checkpoint-dir", blocked(t)],
     "a-file is a file, not a directory (check --log-dir/--checkpoint-dir)"),
    ("a new run into a log directory with another run's metrics",  # the earlier run below sits in t / "run"
     lambda t, r: [*SYNTHETIC, *MLP, "--log-dir", str(t / "run"), "--checkpoint-dir", str(t / "elsewhere")],
     "already holds the metrics of another run (metrics.jsonl); pass --resume to continue that run"),
    ("a new run, without --resume, into another run's checkpoint directory",  # a copy: left as it was, below
     lambda t, r: [*SYNTHETIC, *MLP, "--log-dir", str(t / "new-run"),
                   "--checkpoint-dir", str(shutil.copytree(r / "checkpoints", t / "other-run-checkpoints"))],
     "already holds ckpt-000047; pass --resume to continue that run, or choose another --log-dir/--checkpoint-dir"),
    ("resume with a checkpoint of another model", lambda t, r: resume_from(t, r, model="tests.helpers.models:cnn_sync_bn"),
     "was written by another model"),
    ("resume inside an accumulated update",  # 47 steps per epoch here, so K = 47
     lambda t, r: [*resume_from(t, r, step_in_epoch=5), "--backward-passes-per-step", "47"],
     "inside an update of --backward-passes-per-step 47"),
    ("resume with another seed", lambda t, r: [*resume_from(t, r), "--seed", "1"], "seed: 1 here, 0 there"),
    ("resume with loss scaling added", lambda t, r: [*resume_from(t, r), "--precision", "fp16"],
     "was written with --precision fp32, this run has --precision fp16"),
    ("resume with another optimizer's state", lambda t, r: [*resume_from(t, r), "--optimizer", "adam"],
     "was written with --optimizer sgd, whose state does not fit --optimizer adam's"),
    ("ranks read different data", lambda t, r: per_rank_data(t), "rank 1 loaded other data than rank 0"),
    ("resume with a corrupt checkpoint", lambda t, r: resume_from(t, r, truncate=True), "corrupt or incompatible"),
    ("resume when an interrupted re-save cannot be put back", resume_stuck_re_save,
     "cannot restore interrupted checkpoint"),
    ("--elastic without an elastic launcher", lambda t, r: [*SYNTHETIC, *MLP, "--elastic"],
     "--elastic: this process was not started by an elastic launcher"),
    ("gradient accumulation across epochs", lambda t, r: [*SYNTHETIC, *MLP, "--backward-passes-per-step", "5"],
     "--backward-passes-per-step 5 needs the steps per epoch to be a multiple of 5 so that no update spans "
     "two epochs; here they are 24"),
    ("checkpoints between accumulated passes", lambda t, r: ["--backward-passes-per-step", "2", "--checkpoint-every", "5"],
     "--checkpoint-every 5 must be a multiple of --backward-passes-per-step 2"),
    ("config file with a mistyped key", lambda t, r: run_file(t, "epochs: 1\nbatchsize: 64\n"),
     "run.yaml: unknown key 'batchsize'; did you mean 'batch_size'?"),
    ("config file with a value of the wrong type", lambda t, r: run_file(t, "optim:\n  momentum: high\n"),
     "run.yaml: optim.momentum must be a number, got 'high'"),
    ("config file with a value out of range", lambda t, r: run_file(t, "optim: {base_lr: -1}\n"),
     "run.yaml: optim.base_lr (--lr) must be finite and > 0, got -1.0"),
    ("config file that is not YAML", lambda t, r: run_file(t, "epochs: [1,\n"), "run.yaml is not valid YAML"),
    ("--elastic with gradient accumulation", lambda t, r: ["--elastic", "--backward-passes-per-step", "2"],
     "--elastic cannot be combined with --backward-passes-per-step 2"),
    ("image folder with an empty class folder", lambda t, r: image_folder(t, "empty class"),
     "images/train/class03 holds no images"),
    ("image folder without a test split", lambda t, r: image_folder(t, "no test split"),
     "no test split (a folder test/ or validation/ with the class folders)"),
    ("TFRecord file truncated", lambda t, r: records(t, "truncated"),
     "records/train-00001: record 7 (1-based) is truncated or corrupt, after 6 good record(s)"),
    ("TFRecord record without the label key", lambda t, r: records(t, "no label"),
     "records/train-00000: record 1 (1-based): Feature: image/class/label (data type: int64) is required"),
    ("TFRecord labels beyond --num-classes", lambda t, r: records(t, "") + ["--num-classes", "2"],
     "labels must be in [0, 2), found range [0, 2]: 2 at the training split"),
    ("data function that raises", lambda t, r: ["--data", "tests.helpers.datafns:raises", *MLP],
     "the function raised FileNotFoundError: gs://no-such-bucket/train-*"),
    ("data function returning batches", lambda t, r: ["--data", "tests.helpers.datafns:batched", *MLP],
     "the dataset is batched (images (None, 4, 4, 1))"),
    ("--data with --dataset", lambda t, r: ["--data", "tests.helpers.datafns:counted", "--dataset", "npz"],
     "--data package.module:function is a dataset of its own: give it without --dataset"),
    ("--augment standard without --image-size", lambda t, r: ["--dataset", "folder", "--augment", "standard"],
     "--augment standard crops at random and resizes: it needs --image-size"),
    ("--elastic with TFRecords", lambda t, r: ["--dataset", "tfrecord", "--elastic"],
     "--elastic cannot be combined with --dataset tfrecord: each rank reads its own range of the stream"),
]


if KERAS_3:  # TensorFlow >= 2.16, where `import keras` is Keras 3 and tf.keras is tf_keras (Keras 2)
    CASES += [
        ("a Keras 3 model with --keras 2", lambda t, r: [*SYNTHETIC, "--model", "tests.helpers.models:keras3_mlp", "--keras", "2"],
         "--keras 2, but the model (keras.src.models.sequential.Sequential) is Keras 3: give --keras 3 or leave it out"),
        ("a Keras 3 model holding a Keras 2 layer",
         lambda t, r: [*SYNTHETIC, "--model", "tests.helpers.models:keras3_with_a_keras2_layer"],
         "the model's attribute 'head' (tf_keras.src.layers.core.dense.Dense) is Keras 2: build every object with one "
         "Keras"),
        ("Keras 3 on the JAX backend", lambda t, r: ["-m", "tests.workers.with_env", "KERAS_BACKEND=jax", *SYNTHETIC],
         "its 'jax' backend"),  # "cannot start" without jax installed, "runs on" with it
    ]


def snapshot(root):
    """{relative path: sha256} of every file under ``root``."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, root)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


def recording_exit_status(argv, exits) -> List[str]:
    """``sh -c`` running ``python argv`` and writing its exit status to ``exits/rank-<rank>``.

    horovodrun's own line about a rank it ends after another failed can be lost from its output;
    the file is not. No file: the shell was ended by horovodrun while the rank still ran.
    """
    run = " ".join(shlex.quote(a) for a in [sys.executable, *argv])
    return ["sh", "-c", f'{run}; status=$?; echo $status > {shlex.quote(str(exits))}/rank-"$HOROVOD_RANK"; exit $status']


@pytest.mark.parametrize("make_args, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(tmp_path, tmp_path_factory, make_args, message, request):
    run = request.getfixturevalue("trained_mlp_run") if "resume" in request.node.callspec.id else None
    args = make_args(tmp_path, run)
    # An earlier run's results sit in the default run directory: they must survive.
    earlier = tmp_path / "run"
    earlier.mkdir(exist_ok=True)
    (earlier / "metrics.jsonl").write_text('{"epoch": 1, "from": "an earlier run"}\n')
    if "--log-dir" not in args:
        args += ["--log-dir", str(earlier)]
    before = snapshot(tmp_path)
    start = time.monotonic()
    entry = [] if args[0] == "-m" else ["-m", "hvdtrain"]  # a case may run hvdtrain through a test worker
    exits = tmp_path_factory.mktemp("exit-status")
    argv = recording_exit_status([*entry, *args, "--threads", "1", "--no-progress"], exits)
    proc = subprocess.run(launch(2, argv), env=rank_env(), capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - start
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    # No rank exits 0: each exits non-zero, or is still running when horovodrun ends it after another's failure.
    status = {f.name: int(f.read_text()) for f in exits.iterdir()}
    assert status and 0 not in status.values(), f"exit statuses {status}\n{output[-3000:]}"
    assert len(status) == 2 or "Terminating remaining workers" in output, f"exit statuses {status}\n{output[-3000:]}"
    assert seconds < 30, f"took {seconds:.0f} s"
    assert output.count(message) == 1, f"expected {message!r} once:\n{output[-3000:]}"
    assert message in proc.stderr
    assert not re.search(r"\[\d+\]<stderr>:Traceback", output), "a rank printed a traceback"
    assert "usage:" not in output, "argparse's usage block, not one line"
    assert snapshot(tmp_path) == before, "files on disk changed"


@pytest.mark.skipif(not shutil.which("nvidia-smi"), reason="needs a GPU host: checks more local ranks than GPUs")
def test_more_local_ranks_than_gpus(tmp_path):
    gpus = len(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.splitlines())
    env = rank_env({"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(gpus)))})
    proc = subprocess.run(command(gpus + 1, ["-m", "hvdtrain", *SYNTHETIC, *MLP, "--log-dir", str(tmp_path)]),
                          env=env, capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert output.count(f"{gpus + 1} ranks on this host but only {gpus} visible GPU(s)") == 1, output[-3000:]
