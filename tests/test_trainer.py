"""The training recipe with real ranks: equivalence with one process, broadcast, exact metrics.

Oracle: N ranks with local batch B must take the same steps as one process with batch N*B (same
initial weights, same global batches), to ||w_ranks - w_oracle|| <= tol ||w_oracle|| per tensor
(tests/helpers/oracle.py: 1e-12 in float64, 1e-5 in float32).
"""
import numpy as np
import pytest

from tests.helpers.oracle import assert_same_weights
from tests.helpers.ranks import run_ranks
from tests.helpers.runs import train_steps, weights


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory):
    """``train_steps`` for jobs that several tests compare against: each launched once."""
    done = {}

    def run(np_, model, sizes, steps, *extra, launcher="gloo", onednn="0"):
        key = (np_, model, sizes, steps, extra, launcher, onednn)
        if key not in done:
            done[key] = train_steps(tmp_path_factory.mktemp("shared"), "run", np_, model, sizes, steps, *extra,
                                    launcher=launcher, env={"TF_ENABLE_ONEDNN_OPTS": onednn})
        return done[key]

    return run


def test_broadcast_and_oracle_without_batch_norm(tmp_path, shared_run):
    """2 ranks x 16 == 1 process x 32 for 10 SGD steps, for a model without batch norm; ranks
    started from different seeds hold rank 0's variables after start-up."""
    ranks = shared_run(2, "tests.helpers.models:mlp", "16,16", 10)
    oracle = train_steps(tmp_path, "oracle", 1, "tests.helpers.models:mlp", "32", 10, launcher="single")
    r0, r1 = weights(ranks, 0), weights(ranks, 1)
    # Broadcast: the ranks initialised differently (seed + rank), then hold identical variables.
    assert any(not np.array_equal(r0[k], r1[k]) for k in r0 if k.startswith("before_broadcast/"))
    for k in r0:
        if not k.startswith("before_broadcast/"):
            np.testing.assert_array_equal(r0[k], r1[k], err_msg=k)
    assert r0["iterations"] == 10
    assert_same_weights(r0, weights(oracle))


@pytest.mark.parametrize("sizes, precision, onednn", [("5,27", "fp64", "0"), ("16,16", "fp32", "0"),
                                                     ("5,27", "fp32", "0"), ("5,27", "fp32", None)],
                         ids=["uneven-float64", "equal", "uneven", "uneven-onednn-default"])
def test_sync_bn_cnn_matches_global_batch(sizes, precision, onednn, shared_run):
    """20 SGD steps of a CNN with SyncBatchNormalization: 2 ranks == 1 process on the global batch
    of 32, also with uneven local batches (the loss is scaled to the global batch). Every rank
    ends with the oracle's weights and moving statistics. In float64 the layer takes TensorFlow's
    ops, in float32 hvdtrain's CPU kernels; oneDNN's kernels pinned off, or as TensorFlow sets them
    on this host (None)."""
    extra = ("--precision", precision)
    ranks = shared_run(2, "tests.helpers.models:cnn_sync_bn", sizes, 20, *extra, onednn=onednn)
    oracle = weights(shared_run(1, "tests.helpers.models:cnn_sync_bn", "32", 20, *extra, launcher="single",
                                onednn=onednn))
    for rank in (0, 1):
        assert_same_weights(weights(ranks, rank), oracle, dtype=np.float64 if precision == "fp64" else np.float32)


@pytest.mark.parametrize("np_, num_test", [(2, 1001), (3, 100)])
def test_global_metrics_equal_single_process(tmp_path, np_, num_test):
    """Evaluation split over ranks (uneven shards, partial batches) gives the one-process metrics."""
    run_ranks(np_, ["-m", "tests.workers.evaluate", str(tmp_path), str(num_test)], timeout=240)
    results = [np.load(tmp_path / f"rank{r}.npz") for r in range(np_)]
    from hvdtrain.data.in_memory import make_synthetic
    from tests.helpers.models import mlp

    data = make_synthetic(num_train=64, num_test=num_test, image_shape=(8, 8, 1), seed=5)
    model = mlp(data.input_shape, data.num_classes)
    model.set_weights([results[0][f"w{i}"] for i in range(len(model.get_weights()))])
    logits = model(data.x_test.astype(np.float32) / 255.0).numpy().astype(np.float64)
    log_probs = logits - np.log(np.sum(np.exp(logits - logits.max(1, keepdims=True)), 1, keepdims=True)) - logits.max(1, keepdims=True)
    loss = -np.mean(log_probs[np.arange(num_test), data.y_test])
    accuracy = np.mean(np.argmax(logits, 1) == data.y_test)
    for r in results:  # every rank reports the same global metrics
        assert int(r["count"]) == num_test
        assert float(r["accuracy"]) == pytest.approx(accuracy, abs=1e-12)
        assert float(r["loss"]) == pytest.approx(loss, rel=1e-6)


def test_gradient_accumulation_equals_larger_batch(tmp_path, shared_run):
    """--backward-passes-per-step 2 on local batches of 8 == one pass on local batches of 16."""
    accumulated = train_steps(tmp_path, "acc", 2, "tests.helpers.models:mlp", "8,8", 20, "--backward-passes-per-step", "2")
    plain = shared_run(2, "tests.helpers.models:mlp", "16,16", 10)
    assert_same_weights(weights(accumulated), weights(plain))


def test_fp16_allreduce_equals_fp32_to_half_precision(tmp_path, shared_run):
    """One step with gradients compressed to float16 for the allreduce: the update differs from the
    float32 one by float16 rounding only (relative 2^-11 per element, so 1e-3 in norm)."""
    # The first of 10 steps: the fp32 job is the one the oracle tests share (same data: 10 global batches).
    fp16 = weights(train_steps(tmp_path, "fp16", 2, "tests.helpers.models:mlp", "16,16", 10, "--fp16-allreduce"))
    fp32 = weights(shared_run(2, "tests.helpers.models:mlp", "16,16", 10))
    keys = [k for k in fp32 if k.startswith("step1/")]
    assert keys
    for k in keys:
        initial = fp32["initial/" + k[len("step1/"):]]
        update16, update32 = fp16[k] - initial, fp32[k] - initial
        assert np.linalg.norm(update16 - update32) <= 1e-3 * np.linalg.norm(update32), k
        assert not np.array_equal(update16, update32) or not update32.any(), "compression had no effect"


def test_per_rank_moving_statistics_are_those_of_every_built_keras_batch_norm():
    """What the trainer averages over the ranks before an evaluation or a save: the statistics of
    Keras' batch norm layers (nested, Keras' synchronized variant and renorm's included) and of
    hvdtrain's layer with ``synchronized=False``, not those of hvdtrain's synchronized layer
    (identical on every rank already) nor of a layer never called."""
    import tensorflow as tf

    from hvdtrain.keras2 import SyncBatchNormalization
    from hvdtrain.model.moving_statistics import per_rank_moving_statistics

    inner = tf.keras.Sequential([tf.keras.layers.BatchNormalization(renorm=True, name="renorm")], name="inner")
    unused = tf.keras.layers.BatchNormalization(name="unused")
    inputs = tf.keras.Input((4,))
    x = inner(tf.keras.layers.BatchNormalization(name="plain", dtype="float64")(inputs))
    x = tf.keras.layers.experimental.SyncBatchNormalization(name="keras_sync")(x)
    x = SyncBatchNormalization(name="ours_per_rank", synchronized=False)(x)
    model = tf.keras.Model(inputs, SyncBatchNormalization(name="ours")(x))
    model.unused = unused  # tracked, never built
    names = sorted(v.name for v in per_rank_moving_statistics(model))
    assert names == sorted(f"{layer}/{stat}:0" for layer, stats in [
        ("plain", ["moving_mean", "moving_variance"]), ("keras_sync", ["moving_mean", "moving_variance"]),
        ("ours_per_rank", ["moving_mean", "moving_variance"]),
        ("renorm", ["moving_mean", "moving_variance", "moving_stddev", "renorm_mean", "renorm_stddev"])]
        for stat in stats), names
