"""hvdtrain.fit with a Keras callback it refuses (TensorBoard: hvdtrain writes its own), after an
hvdtrain callback that must be closed all the same. Run at two ranks by tests/test_users_keras.py.

    python refused_keras_callback.py OUT_DIR
"""
import json
import os
import sys

import numpy as np
import tensorflow as tf

import hvdtrain
from hvdtrain.errors import HvdtrainError

out = sys.argv[1]
rank = int(os.environ.get("HOROVOD_RANK", "0"))


class Closed(hvdtrain.Callback):
    """Says whether the run closed it (a chief-only callback: rank 0's, opened beside its logs)."""

    chief_only = True
    closed = False

    def close(self):
        Closed.closed = True


def build(input_shape, num_classes):
    return tf.keras.Sequential([tf.keras.Input(input_shape), tf.keras.layers.Flatten(),
                                tf.keras.layers.Dense(num_classes)])


rng = np.random.default_rng(0)
x, y = rng.integers(0, 256, (64, 8, 8, 1), dtype=np.uint8), rng.integers(0, 10, 64)
report = {}
try:
    hvdtrain.fit(build, (x, y, x[:16], y[:16]), loss="sparse_categorical_crossentropy", epochs=1, batch_size=8,
                 callbacks=[Closed(), tf.keras.callbacks.TensorBoard(os.path.join(out, "board"))],
                 log={"dir": os.path.join(out, "run"), "progress": False})
except HvdtrainError as e:
    report["error"] = str(e)
report["closed"] = Closed.closed
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
