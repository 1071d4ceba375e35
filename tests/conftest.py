"""Fixtures shared by the test modules."""
import subprocess

import pytest

from tests.ranks import command, rank_env


@pytest.fixture(scope="session")
def trained_mlp_run(tmp_path_factory):
    """A run directory after one epoch of ``tests.models:mlp`` on the synthetic data at np=2 over
    Gloo, local batch 64 (47 steps: ``checkpoints/ckpt-000047``, one line in ``metrics.jsonl``).

    Trained once per session and shared: copy it before writing to it.
    """
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    args = ["-m", "hvdtrain", "--dataset", "synthetic", "--model", "tests.models:mlp", "--epochs", "1",
            "--batch-size", "64", "--no-progress", "--threads", "1", "--log-dir", str(run_dir)]
    subprocess.run(command(2, args), env=rank_env(), check=True, capture_output=True, timeout=300)
    return run_dir
