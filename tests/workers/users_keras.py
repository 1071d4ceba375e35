"""A user's own Keras script, as users write it: TensorFlow first (an op runs before hvdtrain is
imported), their model with Keras BatchNormalization, their optimizer, tf.data datasets and stock
Keras callbacks built before hvdtrain.fit. Run at two ranks by tests/test_users_keras.py.

    python users_keras.py OUT_DIR MODE [KERAS]   MODE: callbacks | stop-on-rank-1 | data-function
                                                 KERAS: 2 (tf.keras, the default) | 3 (`import keras`)
"""
import json
import os
import sys

import numpy as np
import tensorflow as tf

tf.constant(1.0) + 1.0  # TensorFlow's runtime starts here, before hvdtrain can pin anything

import hvdtrain  # noqa: E402
from hvdtrain.config import DEFAULT_DATA_DIR  # noqa: E402
from hvdtrain.data.in_memory import load_dataset  # noqa: E402

out, mode = sys.argv[1], sys.argv[2]
if sys.argv[3:] == ["3"]:  # a Keras 3 user: `import keras`, Keras 3's layers, optimizer and callbacks
    import keras as K  # noqa: N812
else:
    K = tf.keras  # noqa: N816 -- Keras 2 after `import hvdtrain`
data = load_dataset("idx", DEFAULT_DATA_DIR, 0, "classes")
images, labels = data.x_train[:1200] / 255.0, data.y_train[:1200].astype(np.int32)
test_images, test_labels = data.x_test[:400] / 255.0, data.y_test[:400].astype(np.int32)


def make_data(split, rank, world_size, seed, epoch):
    """A data function in the script itself (--data users_keras:make_data)."""
    x, y = (images, labels) if split == "train" else (test_images, test_labels)
    return tf.data.Dataset.from_tensor_slices((x.astype(np.float32), y)).shuffle(2000, seed=seed + epoch)


def build(input_shape, num_classes):
    return K.Sequential([
        K.Input(input_shape),
        K.layers.Conv2D(8, 3, use_bias=False),
        K.layers.BatchNormalization(),
        K.layers.ReLU(),
        K.layers.GlobalAveragePooling2D(),
        K.layers.Dense(num_classes),
    ])


class StopOnRank1(K.callbacks.Callback):
    """Asks to stop on rank 1 only, after the first epoch: every rank must stop there."""

    def on_epoch_end(self, epoch, logs=None):
        import horovod.tensorflow as hvd

        if hvd.rank() == 1 and epoch == 0:
            self.model.stop_training = True


class Record(K.callbacks.Callback):
    """What this rank's callbacks saw: each epoch's logs and the learning rate."""

    def __init__(self):
        super().__init__()
        self.epochs = []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append({"epoch": epoch, **{k: float(v) for k, v in logs.items()}})

    def on_train_end(self, logs=None):
        self.final_lr = float(np.asarray(self.model.optimizer.learning_rate))


optimizer = K.optimizers.SGD(0.05, momentum=0.9)  # the user's optimizer, built first
record = Record()
callbacks = [record, K.callbacks.TerminateOnNaN()]
settings = dict(epochs=4, batch_size=50, log={"dir": os.path.join(out, "run"), "progress": False})
train = tf.data.Dataset.from_tensor_slices((images.astype(np.float32), labels))
test = tf.data.Dataset.from_tensor_slices((test_images.astype(np.float32), test_labels))
data_arg = (train, test)
if mode == "callbacks":
    callbacks += [
        # Stops after 2 epochs, restoring the first epoch's weights: model.keras must hold those too.
        K.callbacks.EarlyStopping(monitor="val_accuracy", baseline=1.01, patience=2, restore_best_weights=True),
        K.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=0, min_delta=100.0),
        K.callbacks.CSVLogger(os.path.join(out, "log.csv")),
        K.callbacks.ModelCheckpoint(os.path.join(out, "model.weights.h5"), save_weights_only=True),
        K.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: None),
    ]
elif mode == "stop-on-rank-1":
    callbacks.append(StopOnRank1())
elif mode == "data-function":
    data_arg = None
    settings["config"] = {"data": {"dataset": "function", "function": "users_keras:make_data"}}

result = hvdtrain.fit(build, data_arg, loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                      optimizer=optimizer, callbacks=callbacks, convert_sync_bn=True, **settings)

rank = int(os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
layers = result.model._flatten_layers(include_self=False)  # Keras 2 and 3 alike
report = {"history": result.history, "keras_logs": record.epochs, "final_lr": record.final_lr,
          "model_keras": type(result.model).__module__.split(".")[0],
          "sync_layers": sum(type(m).__name__ == "SyncBatchNormalization" for m in layers),
          "keras_layers": sum(type(m).__name__ == "BatchNormalization" for m in layers)}
if rank == 0:
    loaded = hvdtrain.load_model(os.path.join(out, "run", "model.keras"))
    x = test_images[:8, ..., None].astype(np.float32)
    report["loaded_max_diff"] = float(np.abs(np.asarray(loaded(x, training=False))
                                             - np.asarray(result.model(x, training=False))).max())
    report["loaded_keras"] = type(loaded).__module__.split(".")[0]
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
print(f"fit done on rank {rank}: {len(result.history)} epochs")
