"""Mixed precision and XLA with real ranks: N ranks == 1 process on the global batch, fp16's skipped
steps agreed by every rank, the compiled forward and backward pass, and the dynamic loss scale."""
import json

import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.precision import DynamicLossScale
from tests.helpers.oracle import assert_same_weights
from tests.helpers.ranks import run_ranks
from tests.helpers.runs import train_steps, weights

MODEL = "tests.helpers.models:cnn_sync_bn"


def test_bf16_step_matches_one_process_on_the_global_batch(tmp_path):
    """One step of a CNN with synchronized BatchNorm at local batches 5 + 27 against one process at
    32, under bf16. The layers' sums over the batch (kernel and bias gradients) run in bfloat16 on
    this CPU, so a different order of the same examples changes them: the tolerance per tensor is
    twice what one process changes by when its batch is fed in reverse order, plus one bfloat16
    rounding (2^-8) of the update, since each rank's gradient is rounded to bfloat16 once more
    before the float32 allreduce, plus float32's 1e-5. (Later steps only compound these roundings;
    the Fashion-MNIST test below checks where training ends.)"""
    extra = ["--precision", "bf16"]
    ranks = weights(train_steps(tmp_path, "ranks", 2, MODEL, "5,27", 1, *extra))
    oracle = weights(train_steps(tmp_path, "oracle", 1, MODEL, "32", 1, *extra, launcher="single"))
    reordered = weights(train_steps(tmp_path, "reversed", 1, MODEL, "32", 1, *extra, "--reverse", launcher="single"))
    for key in (k for k in oracle if k.startswith("final/")):
        update = np.linalg.norm(oracle[key] - oracle[key.replace("final/", "initial/")])
        assert update > 0, f"{key} did not train"
        reorder = np.linalg.norm(reordered[key] - oracle[key])
        tolerance = 2 * reorder + 2.0 ** -8 * update + 1e-5 * np.linalg.norm(oracle[key])
        delta = np.linalg.norm(ranks[key] - oracle[key])
        assert delta <= tolerance, f"{key}: |dw| = {delta:.3g}, reversed batch {reorder:.3g}, update {update:.3g}"


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    """Rank 1's batch at step 3 overflows float16 (its images x 1e6); rank 0's does not. Every rank
    skips that step: the weights and BatchNorm's moving statistics after it are those before it,
    the ranks stay identical, and each halves its loss scale once."""
    out = train_steps(tmp_path, "ranks", 2, MODEL, "16,16", 6, "--precision", "fp16", "--overflow", "1:3")
    ranks = [weights(out, rank) for rank in (0, 1)]
    for w in ranks:
        assert int(w["skipped_steps"]) == 1 and float(w["loss_scale"]) == 2.0 ** 14
        assert int(w["iterations"]) == 5  # six steps, one skipped
        for key in (k for k in w if k.startswith("before_overflow/")):
            np.testing.assert_array_equal(w[key.replace("before_overflow/", "after_overflow/")], w[key], err_msg=key)
    for key in (k for k in ranks[0] if k.startswith(("after_overflow/", "final/"))):
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=key)
    assert all(np.all(np.isfinite(v)) for k, v in ranks[0].items() if k.startswith("final/"))


def test_xla_matches_one_process_on_the_global_batch(tmp_path):
    """--xla at np=2 (local batches 5 + 27, per-rank BatchNorm-free CNN... an MLP) against one process
    at 32 without XLA: the compiled forward and backward pass, the allreduce outside it. XLA fuses
    and reorders float32 arithmetic, hence 1e-5 rather than bit equality."""
    ranks = train_steps(tmp_path, "ranks", 2, "tests.helpers.models:mlp", "5,27", 10, "--xla")
    oracle = weights(train_steps(tmp_path, "oracle", 1, "tests.helpers.models:mlp", "32", 10, launcher="single"))
    for rank in (0, 1):
        w = weights(ranks, rank)
        assert int(w["compiled_by_xla"]) == 1
        assert_same_weights(w, oracle)


def test_dynamic_loss_scale_halves_on_overflow_and_doubles_after_a_run_of_finite_steps():
    optimizer = tf.keras.optimizers.SGD(0.1)
    optimizer.build([tf.Variable(1.0)])
    scale = DynamicLossScale(optimizer, initial_scale=8.0, growth_interval=3)
    assert {"loss_scale", "loss_scale_finite_steps", "loss_scale_skipped_steps"} <= {
        v.name.split(":")[0].split("/")[-1] for v in optimizer.variables}  # checkpointed and broadcast with it
    seen = []
    for finite in [True, True, False, True, True, True, True]:
        scale.update(tf.constant(finite))
        seen.append(float(scale.scale.numpy()))
    assert seen == [8.0, 8.0, 4.0, 4.0, 4.0, 8.0, 8.0]
    assert int(scale.skipped_steps.numpy()) == 1
    gradients = scale.unscale([tf.constant([16.0, np.inf]), None])
    assert gradients[1] is None and list(gradients[0].numpy()) == [2.0, np.inf]
    assert not bool(DynamicLossScale.all_finite(gradients)) and bool(DynamicLossScale.all_finite([tf.ones(2)]))


def train_mlp_on_fashion(run_dir, job, precision) -> dict:
    """3 epochs of an MLP at np=2 on a fifth of Fashion-MNIST; the last metrics.jsonl line."""
    run_ranks(2, ["-m", "hvdtrain", *job, "--epochs", "3", "--model", "tests.helpers.models:mlp", "--precision", precision,
                  "--log-dir", str(run_dir)], timeout=600)
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f][-1]


@pytest.fixture(scope="module")
def fp32_mlp_metrics(tmp_path_factory, fashion_slice_job):
    return train_mlp_on_fashion(tmp_path_factory.mktemp("fp32"), fashion_slice_job, "fp32")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_as_fp32_on_fashion_mnist(tmp_path, precision, fashion_slice_job, fp32_mlp_metrics):
    """np=2 on real data reaches float32's test accuracy within 1 point. (An MLP: half precision
    runs 2-6x slower than float32 on this CPU; BatchNorm under it is checked against its oracle.)"""
    last = train_mlp_on_fashion(tmp_path, fashion_slice_job, precision)
    assert last["test_accuracy"] == pytest.approx(fp32_mlp_metrics["test_accuracy"], abs=0.01)
    assert last["test_accuracy"] > 0.8
    skipped = last.get("skipped_steps", 0)  # fp16: a skipped step's examples are not counted as trained
    assert 0 <= skipped <= 20 and (precision == "fp16" or skipped == 0)
    global_batch = 2 * 128
    assert 0 <= fp32_mlp_metrics["train_examples"] - last["train_examples"] <= skipped * global_batch
