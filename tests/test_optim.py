"""The optimizers (N ranks == 1 process for each) and the learning-rate schedule: linear warmup to
base_lr x world size, cosine decay, and elastic rescaling."""
import math

import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.config import OptimConfig
from hvdtrain.optim import WarmupSchedule, rescale_schedule
from tests.helpers.oracle import assert_same_weights
from tests.helpers.ranks import run_ranks
from tests.helpers.runs import train_steps, weights


def lr(schedule, step):
    return float(schedule(tf.constant(step, tf.int64)))


def test_warmup_then_cosine():
    s = WarmupSchedule(base_lr=0.1, world_size=4, warmup_steps=10, total_steps=110)
    assert lr(s, 0) == pytest.approx(0.1)
    assert lr(s, 5) == pytest.approx(0.1 + 0.3 * 5 / 10)
    assert lr(s, 10) == pytest.approx(0.4)
    assert lr(s, 60) == pytest.approx(0.5 * 0.4 * (1 + math.cos(math.pi * 0.5)))
    assert lr(s, 110) == pytest.approx(0.0, abs=1e-7) and lr(s, 500) == pytest.approx(0.0, abs=1e-7)
    constant = WarmupSchedule(base_lr=0.1, world_size=4, warmup_steps=10, total_steps=110, decay="constant")
    assert lr(constant, 100) == pytest.approx(0.4)


def test_warmup_then_linear_and_step_decay():
    linear = WarmupSchedule(base_lr=0.1, world_size=4, warmup_steps=10, total_steps=110, decay="linear")
    assert [lr(linear, s) for s in (5, 10, 35, 110, 200)] == pytest.approx([0.25, 0.4, 0.3, 0.0, 0.0], abs=1e-7)
    step = WarmupSchedule(base_lr=0.1, world_size=4, warmup_steps=10, total_steps=200, decay="step")
    assert [lr(step, s) for s in (5, 10, 99, 100, 149, 150, 199)] == pytest.approx(
        [0.25, 0.4, 0.4, 0.04, 0.04, 0.004, 0.004])


def test_a_schedule_saved_before_decay_existed_still_loads():
    """Optimizers saved with the old ``cosine`` flag (in checkpoints' configs) rebuild the same schedule."""
    old = WarmupSchedule.from_config({"base_lr": 0.1, "world_size": 2, "warmup_steps": 0, "total_steps": 10,
                                      "cosine": False, "step_offset": 0})
    assert old.decay == "constant" and WarmupSchedule.from_config(old.get_config()).get_config() == old.get_config()
    with pytest.raises(ValueError, match="decay must be one of"):
        WarmupSchedule(0.1, 1, 0, 10, decay="exponential")


@pytest.mark.parametrize("old_size, new_size, iterations", [(2, 1, 150), (1, 3, 450), (4, 2, 20)])
def test_rescaled_schedule_continues_at_the_same_epoch(old_size, new_size, iterations):
    """After a resize, the rate is what a run at the new world size would have at the same point in epochs."""
    config = OptimConfig(base_lr=0.05, warmup_epochs=1.0)
    n, batch, epochs = 12800, 32, 5
    old_steps, new_steps = n // (old_size * batch), n // (new_size * batch)
    optimizer = tf.keras.optimizers.SGD(0.1)
    optimizer.build([tf.Variable(1.0)])
    optimizer.iterations.assign(iterations)
    epochs_done = iterations / old_steps
    schedule = rescale_schedule(optimizer, config, new_size, new_steps, epochs, epochs_done)
    assert optimizer._learning_rate is schedule
    fresh = WarmupSchedule(0.05, new_size, warmup_steps=new_steps, total_steps=new_steps * epochs)
    for later in (0, 7, 100):
        expected = lr(fresh, round(epochs_done * new_steps) + later)
        assert np.isclose(lr(schedule, iterations + later), expected, rtol=1e-6), later


# ---- the optimizers with real ranks: N ranks == 1 process on the global batch -------------------------------
# AdamW is Keras' Adam with decoupled decay; clipping is the optimizers' common code (one case each).
# In float64, where a real discrepancy stands 1e4 above rounding (tests/helpers/oracle.py).
FP64 = ["--precision", "fp64"]
OPTIMIZER_CASES = {
    "adamw": ["--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.5", *FP64],
    "sgd-nesterov-weight-decay-clip-norm": ["--nesterov", "--weight-decay", "0.5",
                                            "--clip-norm", "0.05", *FP64],  # well below the gradient's norm: every step clips
}


@pytest.fixture(scope="module")
def plain_sgd(tmp_path_factory):
    return weights(train_steps(tmp_path_factory.mktemp("sgd"), "sgd", 1, "tests.helpers.models:cnn_sync_bn", "32", 10,
                               *FP64, launcher="single"))


@pytest.mark.parametrize("case", OPTIMIZER_CASES)
def test_every_optimizer_matches_one_process_on_the_global_batch(tmp_path, case, plain_sgd):
    """10 steps of a CNN with SyncBN at uneven local batches 5 + 27 == one process at 32, for each
    optimizer and option: Keras clips the gradient and decays the weights after Horovod's
    allreduce, as one process on the global batch does. Each option changes the result (its
    weights are far from plain SGD's), so the comparison is not of two no-ops."""
    extra = OPTIMIZER_CASES[case]
    ranks = train_steps(tmp_path, "ranks", 2, "tests.helpers.models:cnn_sync_bn", "5,27", 10, *extra)
    oracle = weights(train_steps(tmp_path, "oracle", 1, "tests.helpers.models:cnn_sync_bn", "32", 10, *extra,
                                 launcher="single"))
    for rank in (0, 1):
        assert_same_weights(weights(ranks, rank), oracle, dtype=np.float64)
    changed = [k for k in oracle if k.startswith("final/") and oracle[k].ndim >= 2
               and np.linalg.norm(oracle[k] - plain_sgd[k]) > 1e-3 * np.linalg.norm(plain_sgd[k])]
    assert changed, f"{case} trained the kernels as plain SGD does"


def test_weight_decay_scales_kernels_and_leaves_biases():
    """Decoupled decay with a zero gradient: a kernel is multiplied by 1 - lr x weight decay, a
    bias (rank 1: biases, BatchNorm's scale and offset) is left as it is."""
    code = """
import tensorflow as tf
from hvdtrain.runtime.dist import init_distributed
from hvdtrain.config import OptimConfig
from hvdtrain.optim import build_optimizer
ctx = init_distributed(threads=1)
kernel, bias = tf.Variable(tf.ones([2, 2])), tf.Variable(tf.ones([2]))
config = OptimConfig(name="adamw", base_lr=0.1, weight_decay=0.5, warmup_epochs=0, lr_schedule="constant")
optimizer, _ = build_optimizer(config, 1, 10, 1, variables=[kernel, bias])
optimizer.apply_gradients([(tf.zeros([2, 2]), kernel), (tf.zeros([2]), bias)])
print("RESULT", float(kernel[0, 0]), float(bias[0]))
"""
    out = run_ranks(1, ["-c", code], launcher="single").stdout
    kernel, bias = map(float, out.split("RESULT")[1].split())
    assert kernel == pytest.approx(1 - 0.1 * 0.5, rel=1e-6) and bias == 1.0
