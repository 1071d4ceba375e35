"""Divergence checks from allreduced values (every rank raises alike; real ranks: test_trainer.py)."""
import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.divergence import checked, non_finite_counter
from hvdtrain.errors import EveryRankError


def test_a_non_finite_loss_stops_naming_where_and_a_finite_one_passes():
    assert checked({"loss": 0.5, "count": 4}, 0, 2) == {"loss": 0.5, "count": 4}
    with pytest.raises(EveryRankError, match=r"the global training loss is nan at epoch 2, step 3"):
        checked({"loss": float("nan"), "count": 4}, 1, 2)
    with pytest.raises(EveryRankError, match=r"training d_loss is inf"):  # a GAN's step reports no "loss"
        checked({"d_loss": float("inf"), "g_loss": 1.0, "count": 4}, 0, 0)


def test_the_counter_counts_nan_and_inf_in_floating_variables_only():
    model = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(3)])
    count = non_finite_counter(model)
    assert int(count()) == 0
    kernel = model.layers[0].kernel
    kernel.assign(np.array([[np.nan, 1, 2], [np.inf, -np.inf, 0]], np.float32))
    assert int(count()) == 3
