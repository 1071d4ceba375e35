"""Rank worker: a user's Keras 3 script in float64 (``keras.config.set_floatx`` before hvdtrain.fit):
a CNN with two Keras BatchNormalization layers, converted, the user's SGD(0.05, momentum=0.9), one
epoch of 2,048 Fashion-MNIST images; rank 0 saves the trained weights.

Usage: python -m tests.workers.floatx_fit FLOATX LOCAL_BATCH OUT_DIR
"""
import sys

import keras
import numpy as np

import hvdtrain

floatx, batch, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
keras.config.set_floatx(floatx)
ctx = hvdtrain.init_distributed()

from hvdtrain.config import DEFAULT_DATA_DIR  # noqa: E402
from hvdtrain.data.in_memory import load_idx_dir  # noqa: E402


def build(input_shape, num_classes):
    keras.utils.set_random_seed(1)
    inputs = keras.Input(input_shape)
    h = keras.layers.ReLU()(keras.layers.BatchNormalization()(keras.layers.Conv2D(8, 3, use_bias=False)(inputs)))
    h = keras.layers.Dense(32, use_bias=False)(keras.layers.Flatten()(h))
    h = keras.layers.ReLU()(keras.layers.BatchNormalization()(h))
    return keras.Model(inputs, keras.layers.Dense(num_classes)(h))


d = load_idx_dir(DEFAULT_DATA_DIR)
result = hvdtrain.fit(build, (d.x_train[:2048], d.y_train[:2048], d.x_test[:256], d.y_test[:256]),
                      optimizer=keras.optimizers.SGD(0.05, momentum=0.9), convert_sync_bn=True, epochs=1,
                      batch_size=batch, log={"dir": out, "progress": False}, seed=0)
if result.is_chief:
    np.savez(f"{out}/weights.npz", **{f"final/{i}": np.asarray(v) for i, v in enumerate(result.model.weights)})
