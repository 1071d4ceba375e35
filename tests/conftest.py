"""Fixtures shared by the test modules."""
import json
import os
import subprocess

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")  # as in the ranks' environment (tests.helpers.ranks.rank_env)

import numpy as np
import pytest

from tests.helpers.ranks import command, rank_env, run_ranks


@pytest.fixture(scope="session")
def trained_mlp_run(tmp_path_factory):
    """A run directory after one epoch of ``tests.helpers.models:mlp`` on the synthetic data at np=2 over
    Gloo, local batch 64 (47 steps: ``checkpoints/ckpt-000047``, one line in ``metrics.jsonl``).

    Trained once per session and shared: copy it before writing to it.
    """
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    args = ["-m", "hvdtrain", "--dataset", "synthetic", "--model", "tests.helpers.models:mlp", "--epochs", "1",
            "--batch-size", "64", "--no-progress", "--threads", "1", "--log-dir", str(run_dir)]
    subprocess.run(command(2, args), env=rank_env(), check=True, capture_output=True, timeout=300)
    return run_dir


@pytest.fixture(scope="session")
def fashion_slice_job(tmp_path_factory):
    """hvdtrain flags for one epoch of the default model, single-threaded ranks so that every
    launcher and placement computes alike, on the first 12,000 training and 2,000 test images of
    Fashion-MNIST (real data, a fifth of the full epoch; the full default job runs in test_cli.py)."""
    from hvdtrain.config import DEFAULT_DATA_DIR
    from hvdtrain.data.in_memory import load_idx_dir

    if not os.path.isdir(DEFAULT_DATA_DIR):
        pytest.skip("Debian's dataset-fashion-mnist is not installed")
    full = load_idx_dir(DEFAULT_DATA_DIR)
    path = tmp_path_factory.mktemp("data") / "fashion-slice.npz"
    np.savez(path, x_train=full.x_train[:12000], y_train=full.y_train[:12000],
             x_test=full.x_test[:2000], y_test=full.y_test[:2000])
    return ["--epochs", "1", "--threads", "1", "--no-progress", "--seed", "0", "--dataset", "npz", "--data-dir", str(path)]


@pytest.fixture(scope="session")
def fashion_slice_gloo_metrics(tmp_path_factory, fashion_slice_job):
    """The last ``metrics.jsonl`` line of ``fashion_slice_job`` at np=2 on this host, over Gloo:
    what the same job under another launcher or across hosts must match."""
    run_dir = tmp_path_factory.mktemp("fashion_slice_gloo")
    run_ranks(2, ["-m", "hvdtrain", *fashion_slice_job, "--log-dir", str(run_dir)], timeout=600)
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f][-1]


@pytest.fixture(scope="module")
def cifar_like(tmp_path_factory):
    """Fashion-MNIST as 32x32x3 images (padded, grey in three channels), the shape MobileNetV2 is built for."""
    from hvdtrain.config import DEFAULT_DATA_DIR
    from hvdtrain.data.in_memory import load_dataset

    data = load_dataset("idx", DEFAULT_DATA_DIR, 0, "classes")
    pad = ((0, 0), (2, 2), (2, 2), (0, 0))
    x_train, x_test = (np.repeat(np.pad(x[:512], pad), 3, -1) for x in (data.x_train, data.x_test))
    path = tmp_path_factory.mktemp("data") / "fmnist32.npz"
    np.savez(path, x_train=x_train, y_train=data.y_train[:512], x_test=x_test, y_test=data.y_test[:512])
    return ("--dataset", "npz", "--data-dir", str(path))
