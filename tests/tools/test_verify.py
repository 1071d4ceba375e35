"""hvdtrain verify: a model that trains alike at 2 ranks passes; per-rank BatchNorm is caught."""
import subprocess
import sys

from tests.ranks import REPO, rank_env


def verify(model):
    return subprocess.run([sys.executable, "-m", "hvdtrain", "verify", "--np", "2", "--model", model, "--dataset",
                           "synthetic", "--batch-size", "8", "--steps", "5"], cwd=REPO, env=rank_env(None),
                          capture_output=True, text=True, timeout=600)


def test_synchronized_batchnorm_trains_at_two_ranks_as_one_process():
    result = verify("tests.models:cnn_sync_bn")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 steps of tests.models:cnn_sync_bn: world size 2 (local batch 8) against one process (batch 16)" \
        in result.stdout
    assert "hvdtrain verify: equivalent" in result.stdout and "differs" not in result.stdout


def test_keras_batchnorm_is_named_as_differing():
    result = verify("tests.models:cnn_keras_bn")
    assert result.returncode == 1, result.stdout + result.stderr
    marked = [line.split()[0] for line in result.stdout.splitlines() if line.endswith("<-- differs")]
    assert marked and "the model trains differently at 2 ranks" in result.stdout
