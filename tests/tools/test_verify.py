"""hvdtrain verify: a model that trains alike at 2 ranks passes, in float64; per-rank BatchNorm is
caught, and a real model (MobileNetV2), whose training amplifies rounding, passes once converted; a
model that cannot compute in float64 is compared in float32, naming the layer that cannot."""
import subprocess
import sys

import pytest

from tests.helpers.kerases import KERAS_3, needs_keras3
from tests.helpers.ranks import REPO, rank_env


def verify(model, *args, dataset=("--dataset", "synthetic")):
    return subprocess.run([sys.executable, "-m", "hvdtrain", "verify", "--np", "2", "--model", model, *dataset,
                           "--batch-size", "8", "--steps", "5", *args], cwd=REPO, env=rank_env(None),
                          capture_output=True, text=True, timeout=600)


def test_synchronized_batchnorm_trains_at_two_ranks_as_one_process():
    result = verify("tests.helpers.models:cnn_sync_bn")
    assert result.returncode == 0, result.stdout + result.stderr
    assert ("5 steps of tests.helpers.models:cnn_sync_bn: world size 2 (local batch 8) against one process (batch 16), "
            "in float64") in result.stdout
    assert "hvdtrain verify: equivalent in float64" in result.stdout
    assert "after step 1:" in result.stdout and " 0 of 17 variables beyond 1e-09" in result.stdout
    assert "after step 5:" in result.stdout, "a model whose training does not amplify rounding: every step decides"


def test_keras_batchnorm_is_named_as_differing():
    result = verify("tests.helpers.models:cnn_keras_bn")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "the model trains differently at 2 ranks" in result.stdout
    assert "Keras BatchNormalization layer(s), which normalize each rank's batch alone" in result.stdout
    assert len(result.stdout.splitlines()) < 10  # a summary, not a row per variable


@pytest.mark.parametrize("model, steps", [("mobilenet_v2", "2"), pytest.param("keras3_mobilenet_v2", "10", marks=needs_keras3)])
@pytest.mark.parametrize("convert", [True, False])
def test_mobilenet_v2_passes_converted_and_fails_as_it_is(cifar_like, convert, model, steps):
    """In float64 the converted model agrees to 1e-13 after step 1; from step 2 its training has
    amplified rounding past 1e-12 (the reversed order shows it), so step 1 decides, and 10 steps
    pass. As it is, its 52 Keras BatchNormalization layers are named. Keras 2's and 3's model alike."""
    result = verify(f"tests.helpers.models:{model}", "--steps", steps, *(["--convert-sync-bn"] if convert else []),
                    dataset=cifar_like)
    assert result.returncode == (0 if convert else 1), result.stdout + result.stderr
    assert "in float64" in result.stdout
    if convert:
        assert "hvdtrain verify: equivalent in float64" in result.stdout
        assert "from step 2 the reversed order alone moves the model by more than 1e-12" in result.stdout
    else:
        assert "It has 52 Keras BatchNormalization layer(s)" in result.stdout and "bn_Conv1" in result.stdout


def test_a_model_that_cannot_compute_in_float64_is_compared_in_float32_naming_the_layer():
    result = verify("tests.helpers.models:mlp_with_a_float32_head")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "in float32 (layer 'float32_head' (Dense) computes in float32, so not in float64)" in result.stdout
    assert "hvdtrain verify: equivalent in float32" in result.stdout
    forced = verify("tests.helpers.models:mlp_with_a_float32_head", "--precision", "fp64")
    assert forced.returncode == 2
    assert ("tests.helpers.models:mlp_with_a_float32_head cannot train in float64 (--precision fp64): layer "
            "'float32_head' (Dense) computes in float32") in forced.stderr, forced.stderr


def test_float32_comparison_of_mobilenet_v2_decides_before_rounding_is_amplified(cifar_like):
    """In float32, MobileNetV2's training amplifies rounding from step 2 on (by step 10 the reversed
    order moves it as much as its update, and a comparison there raised a false alarm): the steps
    from that point do not decide."""
    result = verify("tests.helpers.models:keras3_mobilenet_v2" if KERAS_3 else "tests.helpers.models:mobilenet_v2",
                    "--steps", "3", "--convert-sync-bn", "--precision", "fp32", dataset=cifar_like)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "from step 2 the reversed order alone moves the model by more than 1e-06" in result.stdout
    assert "hvdtrain verify: equivalent in float32" in result.stdout


def test_dropout_is_not_taken_for_rounding_noise():
    """Reversing a batch moves each example to another dropout mask: that "noise" is as large as the
    update, and may not excuse the 2-rank run's difference."""
    result = verify("tests.helpers.models:mlp_with_keras_dropout", "--steps", "2")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "it is random per example (Dropout? random augmentation?)" in result.stdout
