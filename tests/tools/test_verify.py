"""hvdtrain verify: a model that trains alike at 2 ranks passes; per-rank BatchNorm is caught, and
a real model (MobileNetV2), whose training amplifies rounding, passes once converted."""
import subprocess
import sys

import pytest

from tests.helpers.kerases import needs_keras3
from tests.helpers.ranks import REPO, rank_env


def verify(model, *args, dataset=("--dataset", "synthetic")):
    return subprocess.run([sys.executable, "-m", "hvdtrain", "verify", "--np", "2", "--model", model, *dataset,
                           "--batch-size", "8", "--steps", "5", *args], cwd=REPO, env=rank_env(None),
                          capture_output=True, text=True, timeout=600)


def test_synchronized_batchnorm_trains_at_two_ranks_as_one_process():
    result = verify("tests.helpers.models:cnn_sync_bn")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 steps of tests.helpers.models:cnn_sync_bn: world size 2 (local batch 8) against one process (batch 16)" \
        in result.stdout
    assert "hvdtrain verify: equivalent" in result.stdout
    assert "after step 1:" in result.stdout and " 0 of " in result.stdout


def test_keras_batchnorm_is_named_as_differing():
    result = verify("tests.helpers.models:cnn_keras_bn")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "the model trains differently at 2 ranks" in result.stdout
    assert "Keras BatchNormalization layer(s), which normalize each rank's batch alone" in result.stdout
    assert len(result.stdout.splitlines()) < 10  # a summary, not a row per variable


@pytest.mark.parametrize("model", ["mobilenet_v2", pytest.param("keras3_mobilenet_v2", marks=needs_keras3)])
@pytest.mark.parametrize("convert", [True, False])
def test_mobilenet_v2_passes_converted_and_fails_as_it_is(cifar_like, convert, model):
    """After 2 steps the converted model is within its rounding noise, though MobileNetV2's training
    amplifies that noise (after 10 steps the reversed order alone moves it as much as its update);
    as it is, its 52 Keras BatchNormalization layers are named. Keras 2's and Keras 3's model alike."""
    result = verify(f"tests.helpers.models:{model}", "--steps", "2", *(["--convert-sync-bn"] if convert else []),
                    dataset=cifar_like)
    assert result.returncode == (0 if convert else 1), result.stdout + result.stderr
    if convert:
        assert "hvdtrain verify: equivalent" in result.stdout
    else:
        assert "It has 52 Keras BatchNormalization layer(s)" in result.stdout and "bn_Conv1" in result.stdout


def test_dropout_is_not_taken_for_rounding_noise():
    """Reversing a batch moves each example to another dropout mask: that "noise" is as large as the
    update, and may not excuse the 2-rank run's difference."""
    result = verify("tests.helpers.models:mlp_with_keras_dropout", "--steps", "2")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "it is random per example (Dropout? random augmentation?)" in result.stdout
