"""The learning-rate schedule: linear warmup to base_lr x world size, cosine decay, and elastic rescaling."""
import math

import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.config import OptimConfig
from hvdtrain.optim import WarmupSchedule, rescale_schedule


def lr(schedule, step):
    return float(schedule(tf.constant(step, tf.int64)))


def test_warmup_then_cosine():
    s = WarmupSchedule(base_lr=0.1, world_size=4, warmup_steps=10, total_steps=110)
    assert lr(s, 0) == pytest.approx(0.1)
    assert lr(s, 5) == pytest.approx(0.1 + 0.3 * 5 / 10)
    assert lr(s, 10) == pytest.approx(0.4)
    assert lr(s, 60) == pytest.approx(0.5 * 0.4 * (1 + math.cos(math.pi * 0.5)))
    assert lr(s, 110) == pytest.approx(0.0, abs=1e-7) and lr(s, 500) == pytest.approx(0.0, abs=1e-7)
    constant = WarmupSchedule(base_lr=0.1, world_size=4, warmup_steps=10, total_steps=110, cosine=False)
    assert lr(constant, 100) == pytest.approx(0.4)


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
