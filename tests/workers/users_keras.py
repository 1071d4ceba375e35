"""A user's own Keras script, as users write it: TensorFlow first (an op runs before hvdtrain is
imported), their model with Keras BatchNormalization, their optimizer, tf.data datasets and stock
Keras callbacks built before hvdtrain.fit. Run at two ranks by tests/test_users_keras.py.

    python users_keras.py OUT_DIR MODE      MODE: callbacks | stop-on-rank-1 | data-function
"""
import json
import os
import sys

import numpy as np
import tensorflow as tf

tf.constant(1.0) + 1.0  # TensorFlow's runtime starts here, before hvdtrain can pin anything

import hvdtrain  # noqa: E402
from hvdtrain.config import DEFAULT_DATA_DIR  # noqa: E402
from hvdtrain.data.datasets import load_dataset  # noqa: E402

out, mode = sys.argv[1], sys.argv[2]
data = load_dataset("idx", DEFAULT_DATA_DIR, 0, "classes")
images, labels = data.x_train[:1200] / 255.0, data.y_train[:1200].astype(np.int32)
test_images, test_labels = data.x_test[:400] / 255.0, data.y_test[:400].astype(np.int32)


def make_data(split, rank, world_size, seed, epoch):
    """A data function in the script itself (--data users_keras:make_data)."""
    x, y = (images, labels) if split == "train" else (test_images, test_labels)
    return tf.data.Dataset.from_tensor_slices((x.astype(np.float32), y)).shuffle(2000, seed=seed + epoch)


def build(input_shape, num_classes):
    return tf.keras.Sequential([
        tf.keras.Input(input_shape),
        tf.keras.layers.Conv2D(8, 3, use_bias=False),
        tf.keras.layers.BatchNormalization(),
        tf.keras.layers.ReLU(),
        tf.keras.layers.GlobalAveragePooling2D(),
        tf.keras.layers.Dense(num_classes),
    ])


class StopOnRank1(tf.keras.callbacks.Callback):
    """Asks to stop on rank 1 only, after the first epoch: every rank must stop there."""

    def on_epoch_end(self, epoch, logs=None):
        import horovod.tensorflow as hvd

        if hvd.rank() == 1 and epoch == 0:
            self.model.stop_training = True


class Record(tf.keras.callbacks.Callback):
    """What this rank's callbacks saw: each epoch's logs and the learning rate."""

    def __init__(self):
        super().__init__()
        self.epochs = []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append({"epoch": epoch, **{k: float(v) for k, v in logs.items()}})

    def on_train_end(self, logs=None):
        self.final_lr = float(tf.keras.backend.get_value(self.model.optimizer.learning_rate))


optimizer = tf.keras.optimizers.SGD(0.05, momentum=0.9)  # the user's optimizer, built first
record = Record()
callbacks = [record, tf.keras.callbacks.TerminateOnNaN()]
settings = dict(epochs=4, batch_size=50, log={"dir": os.path.join(out, "run"), "progress": False})
train = tf.data.Dataset.from_tensor_slices((images.astype(np.float32), labels))
test = tf.data.Dataset.from_tensor_slices((test_images.astype(np.float32), test_labels))
data_arg = (train, test)
if mode == "callbacks":
    callbacks += [
        # Stops after 2 epochs, restoring the first epoch's weights: model.keras must hold those too.
        tf.keras.callbacks.EarlyStopping(monitor="val_accuracy", baseline=1.01, patience=2, restore_best_weights=True),
        tf.keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=0, min_delta=100.0),
        tf.keras.callbacks.CSVLogger(os.path.join(out, "log.csv")),
        tf.keras.callbacks.ModelCheckpoint(os.path.join(out, "weights.h5"), save_weights_only=True),
        tf.keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: None),
    ]
elif mode == "stop-on-rank-1":
    callbacks.append(StopOnRank1())
elif mode == "data-function":
    data_arg = None
    settings["config"] = {"data": {"dataset": "function", "function": "users_keras:make_data"}}

result = hvdtrain.fit(build, data_arg, loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                      optimizer=optimizer, callbacks=callbacks, convert_sync_bn=True, **settings)

rank = int(os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
report = {"history": result.history, "keras_logs": record.epochs, "final_lr": record.final_lr,
          "sync_layers": sum(isinstance(m, hvdtrain.SyncBatchNormalization) for m in result.model.submodules),
          "keras_layers": sum(type(m).__name__ == "BatchNormalization" for m in result.model.submodules)}
if rank == 0:
    loaded = hvdtrain.load_model(os.path.join(out, "run", "model.keras"))
    x = test_images[:8, ..., None].astype(np.float32)
    report["loaded_max_diff"] = float(np.abs(loaded(x, training=False) - result.model(x, training=False)).max())
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
print(f"fit done on rank {rank}: {len(result.history)} epochs")
