"""Models for tests, importable by ranks as ``--model tests.helpers.models:<function>``."""
import os
import sys
import time

import tensorflow as tf

from hvdtrain.keras2 import SyncBatchNormalization
from hvdtrain.model.zoo import SeededDropout, seed_cnn


def mlp(input_shape, num_classes):
    """No batch norm, no dropout: N ranks x B must equal 1 process x N*B."""
    return tf.keras.Sequential([
        tf.keras.Input(input_shape),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(32, activation="tanh"),
        tf.keras.layers.Dense(num_classes),
    ], name="test_mlp")


def cnn_sync_bn(input_shape, num_classes):
    """A small CNN with synchronized batch norm and a ReLU after each conv/dense layer, no dropout.

    The ReLU is a layer of its own after the first batch norm and fused into the others.
    """
    inputs = tf.keras.Input(input_shape)
    x = tf.keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(inputs)
    x = tf.keras.layers.ReLU()(SyncBatchNormalization()(x))
    x = tf.keras.layers.MaxPool2D()(x)
    x = tf.keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(x)
    x = SyncBatchNormalization(activation="relu")(x)
    x = tf.keras.layers.Flatten()(x)
    x = tf.keras.layers.Dense(16, use_bias=False)(x)
    x = SyncBatchNormalization(activation="relu")(x)
    return tf.keras.Model(inputs, tf.keras.layers.Dense(num_classes)(x), name="test_cnn_sync_bn")


def not_a_model(input_shape, num_classes):
    return "not a model"


def exits(input_shape, num_classes):
    """Ends the process with status 0, as a script's main() reused as a model function might."""
    sys.exit(0)


def wrong_outputs(input_shape, num_classes):
    return tf.keras.Sequential([tf.keras.Input(input_shape), tf.keras.layers.Flatten(),
                                tf.keras.layers.Dense(num_classes + 1)])


class _Subclassed(tf.keras.Model):
    """A subclassed model: Keras knows no output shape for it."""

    def __init__(self, outputs):
        super().__init__()
        self.flatten, self.dense = tf.keras.layers.Flatten(), tf.keras.layers.Dense(outputs)

    def call(self, x):
        return self.dense(self.flatten(x))


def subclassed_wrong_outputs(input_shape, num_classes):
    return _Subclassed(num_classes + 2)


def subclassed(input_shape, num_classes):
    return _Subclassed(num_classes)


class _ReturnsADict(tf.keras.Model):
    def __init__(self, outputs):
        super().__init__()
        self.flatten, self.dense = tf.keras.layers.Flatten(), tf.keras.layers.Dense(outputs)

    def call(self, x):
        return {"logits": self.dense(self.flatten(x))}


def returns_a_dict(input_shape, num_classes):
    return _ReturnsADict(num_classes)


def per_pixel_outputs(input_shape, num_classes):
    """Logits for every pixel, (batch, H, W, K): the last dimension is right, the rank is not."""
    return tf.keras.Sequential([tf.keras.Input(input_shape), tf.keras.layers.Conv2D(num_classes, 3)])


def fails_when_called(input_shape, num_classes):
    """Builds, then fails on its first call (its weights expect another input size)."""
    model = tf.keras.Sequential([tf.keras.layers.Flatten(), tf.keras.layers.Dense(num_classes)])
    model.build((None, 7, 7, 1))
    return model


def raises(input_shape, num_classes):
    raise RuntimeError("boom from the user's model")


class _CountsTrainingCalls(tf.keras.layers.Layer):
    """Identity at inference; in training, counts its calls in a variable and applies :meth:`counted`."""

    def __init__(self, calls, **kwargs):
        super().__init__(**kwargs)
        self.limit = calls

    def build(self, input_shape):
        self.calls = self.add_weight(name="calls", shape=(), dtype=tf.int64, initializer="zeros", trainable=False)

    def call(self, x, training=None):
        if not training:
            return x
        self.calls.assign_add(1)
        return self.counted(x)


class _PoisonAfter(_CountsTrainingCalls):
    """Identity for the first `calls` training calls, then NaN: a deterministic divergence."""

    def counted(self, x):
        return x * tf.where(self.calls > self.limit, float("nan"), 1.0)


def diverges_after_120_steps(input_shape, num_classes):
    """The MLP, whose outputs turn NaN from the 121st training step on."""
    model = mlp(input_shape, num_classes)
    return tf.keras.Sequential([model, _PoisonAfter(120)], name="test_diverging")


class _NanUpdateAt(_CountsTrainingCalls):
    """Identity; its gradient is NaN at the `calls`-th training call only: that step's loss is
    finite, its update is not."""

    def counted(self, x):
        poison = tf.equal(self.calls, self.limit)

        @tf.custom_gradient
        def identity(y):
            return tf.identity(y), lambda dy: dy * tf.where(poison, float("nan"), 1.0)

        return identity(x)


def nan_update_at_step_47(input_shape, num_classes):
    """The MLP, whose 47th training step (the last of epoch 1 in the tests) writes NaN weights."""
    return tf.keras.Sequential([mlp(input_shape, num_classes), _NanUpdateAt(47)], name="test_nan_update")


class _NanInferenceAfter(_CountsTrainingCalls):
    """Identity in training; at inference NaN once `calls` training calls have run: finite
    weights and training loss, a NaN test loss."""

    def call(self, x, training=None):
        if training:
            return super().call(x, training=training)
        return x * tf.where(self.calls >= self.limit, float("nan"), 1.0)

    def counted(self, x):
        return x


def nan_test_outputs_after_step_47(input_shape, num_classes):
    """The MLP, whose test outputs turn NaN after 47 training steps (the end of epoch 1 in the tests)."""
    return tf.keras.Sequential([mlp(input_shape, num_classes), _NanInferenceAfter(47)], name="test_nan_outputs")


class _MinusInfinity(tf.keras.layers.Layer):
    """Identity, holding a -inf mask value in a variable of its own, as attention masks do."""

    def build(self, input_shape):
        self.mask_value = self.add_weight(name="mask_value", shape=(), trainable=False,
                                          initializer=tf.keras.initializers.Constant(float("-inf")))

    def call(self, x):
        return x


def mlp_with_an_infinite_variable(input_shape, num_classes):
    """The MLP, with a variable that is -inf from the start (not a divergence)."""
    return tf.keras.Sequential([mlp(input_shape, num_classes), _MinusInfinity()], name="test_minus_inf")


class _WaitsForMarker(_CountsTrainingCalls):
    """Identity; the `calls`-th training call waits until the file $HVDTRAIN_TEST_WAIT_MARKER
    exists (up to 120 s), then 2 s more."""

    def counted(self, x):
        limit = self.limit

        def wait(calls):
            if int(calls) == limit:
                marker, deadline = os.environ["HVDTRAIN_TEST_WAIT_MARKER"], time.time() + 120
                while not os.path.exists(marker) and time.time() < deadline:
                    time.sleep(0.1)
                time.sleep(2.0)
            return calls

        waited = tf.py_function(wait, [self.calls], tf.int64)
        with tf.control_dependencies([waited]):
            return tf.identity(x)


def mlp_waits_at_step_100(input_shape, num_classes):
    """The MLP, whose 100th training step waits for a marker file (see :class:`_WaitsForMarker`)."""
    return tf.keras.Sequential([mlp(input_shape, num_classes), _WaitsForMarker(100)], name="test_waits")


def nan_update_at_step_57(input_shape, num_classes):
    """The MLP, whose 57th training step (epoch 2, step 10 in the tests) writes NaN weights."""
    return tf.keras.Sequential([mlp(input_shape, num_classes), _NanUpdateAt(57)], name="test_nan_update")


def _launcher_rank():
    from hvdtrain.runtime.launcher import launcher_rank

    return launcher_rank()


class _FailOnRank1After(_CountsTrainingCalls):
    """Identity, except that rank 1's 31st training call fails (an error in one rank's data).

    The graph is the same on every rank (Horovod matches collectives by name); only the data differ.
    """

    def __init__(self, calls, rank, **kwargs):
        super().__init__(calls, **kwargs)
        self.rank = rank

    def counted(self, x):
        fine = tf.logical_or(tf.constant(self.rank != 1), self.calls <= self.limit)
        with tf.control_dependencies([tf.debugging.Assert(fine, ["corrupt record in the shard of rank 1"])]):
            return tf.identity(x)


def fails_on_rank_1_mid_training(input_shape, num_classes):
    """The MLP; rank 1 raises InvalidArgumentError at its 31st training step, the others never."""
    return tf.keras.Sequential([mlp(input_shape, num_classes), _FailOnRank1After(30, _launcher_rank())],
                               name="test_fails_on_rank_1")


def hangs_on_rank_1(input_shape, num_classes):
    """Rank 1 never returns from building the model (as if stuck reading data); the others do."""
    if _launcher_rank() == 1:
        import time

        time.sleep(10**6)
    return mlp(input_shape, num_classes)


def fails_where_marker_exists(input_shape, num_classes):
    """:func:`cnn_sync_bn`, but raises in a worker that starts after the file named by
    ``HVDTRAIN_TEST_FAIL_MARKER`` was created (an elastic worker that joins late and fails its start-up)."""
    import os

    marker = os.environ.get("HVDTRAIN_TEST_FAIL_MARKER", "")
    if marker and os.path.exists(marker):
        raise RuntimeError("this worker's start-up fails (test)")
    return cnn_sync_bn(input_shape, num_classes)


class _RankCheckedDropout(SeededDropout):
    """:class:`SeededDropout` that checks, whenever a training step is traced, that its masks are
    keyed by the worker's current rank, and prints the rank it checked."""

    def call(self, inputs, training=None):
        if training:
            import horovod.tensorflow as hvd

            if self.rank != hvd.rank():
                raise RuntimeError(f"dropout masks keyed by rank {self.rank} in the worker at rank {hvd.rank()}")
            print(f"dropout keyed by the current rank {self.rank} of world size {hvd.size()}", flush=True)
        return super().call(inputs, training)


def seed_cnn_rank_checked_dropout(input_shape, num_classes):
    """The seed CNN, whose dropout fails the step's tracing if an elastic reset renumbered the
    worker and its masks still follow the old rank."""
    def clone(layer):
        cls = _RankCheckedDropout if isinstance(layer, SeededDropout) else type(layer)
        return cls.from_config(layer.get_config())

    return tf.keras.models.clone_model(seed_cnn(input_shape, num_classes, rank=_launcher_rank()), clone_function=clone)


def mlp_with_keras_dropout(input_shape, num_classes):
    """Keras' own Dropout, nested in a sub-model: random state outside the model's variables."""
    inner = tf.keras.Sequential([tf.keras.layers.Dense(16, activation="relu"), tf.keras.layers.Dropout(0.2)])
    return tf.keras.Sequential([tf.keras.Input(input_shape), tf.keras.layers.Flatten(), inner,
                                tf.keras.layers.Dense(num_classes)])


def mlp_with_a_float32_head(input_shape, num_classes):
    """:func:`mlp` whose last layer is built with ``dtype="float32"``: it cannot compute in float64."""
    return tf.keras.Sequential([tf.keras.Input(input_shape), tf.keras.layers.Flatten(),
                                tf.keras.layers.Dense(16, activation="tanh"),
                                tf.keras.layers.Dense(num_classes, dtype="float32", name="float32_head")])


def keras3_mlp(input_shape, num_classes):
    """:func:`mlp` built with Keras 3 (``import keras`` on TensorFlow >= 2.16)."""
    import keras

    return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(),
                             keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(num_classes)])


def keras3_cnn_bn(input_shape, num_classes):
    """A small Keras 3 CNN with Keras 3's BatchNormalization (for --convert-sync-bn) and a ReLU
    after each conv/dense layer, no dropout: :func:`cnn_sync_bn`'s shape."""
    import keras

    inputs = keras.Input(input_shape)
    x = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(inputs)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    x = keras.layers.MaxPool2D()(x)
    x = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(x)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization(synchronized=True)(x))
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(16, use_bias=False)(x)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    return keras.Model(inputs, keras.layers.Dense(num_classes)(x), name="test_keras3_cnn_bn")


def keras3_cnn_sync_bn(input_shape, num_classes):
    """:func:`cnn_sync_bn` in Keras 3, with ``hvdtrain.keras3.SyncBatchNormalization``."""
    import keras

    from hvdtrain.keras3 import SyncBatchNormalization as SyncBN3

    inputs = keras.Input(input_shape)
    x = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(inputs)
    x = keras.layers.ReLU()(SyncBN3()(x))
    x = keras.layers.MaxPool2D()(x)
    x = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(x)
    x = SyncBN3(activation="relu")(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(16, use_bias=False)(x)
    x = SyncBN3(activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(num_classes)(x), name="test_keras3_cnn_sync_bn")


def keras3_mobilenet_v2(input_shape, num_classes):
    """Keras 3's MobileNetV2 (alpha 0.35, 32x32x3, no weights, logits): 52 Keras 3 BatchNormalization layers."""
    import keras

    return keras.applications.MobileNetV2(input_shape=tuple(input_shape), alpha=0.35, weights=None,
                                          classes=num_classes, classifier_activation=None)


def keras3_with_a_keras2_layer(input_shape, num_classes):
    """A Keras 3 subclassed model holding a Keras 2 (tf.keras) layer: two Kerases in one model."""
    import keras

    class Mixed(keras.Model):
        def __init__(self):
            super().__init__()
            self.flatten = keras.layers.Flatten()
            self.head = tf.keras.layers.Dense(num_classes)

        def call(self, x):
            return self.head(self.flatten(x))

    return Mixed()


def cnn_keras_bn(input_shape, num_classes):
    """:func:`cnn_sync_bn` with Keras' BatchNormalization: each rank normalizes with its own batch's statistics."""
    inputs = tf.keras.Input(input_shape)
    x = tf.keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(inputs)
    x = tf.keras.layers.ReLU()(tf.keras.layers.BatchNormalization()(x))
    x = tf.keras.layers.Flatten()(tf.keras.layers.MaxPool2D()(x))
    return tf.keras.Model(inputs, tf.keras.layers.Dense(num_classes)(x), name="test_cnn_keras_bn")


def mobilenet_v2(input_shape, num_classes):
    """Keras' own MobileNetV2 (alpha 0.35, 32x32x3, no weights, logits): 52 Keras BatchNormalization layers."""
    return tf.keras.applications.MobileNetV2(input_shape=tuple(input_shape), alpha=0.35, weights=None,
                                             classes=num_classes, classifier_activation=None)


class _KilledOnRank1After(_CountsTrainingCalls):
    """Identity, except that rank 1's process kills itself (SIGKILL) at its 31st training call: a
    rank lost in the first epoch, before any checkpoint."""

    def __init__(self, calls, rank, **kwargs):
        super().__init__(calls, **kwargs)
        self.rank = rank

    def counted(self, x):
        rank, limit = self.rank, self.limit

        def maybe_die(calls):
            if rank == 1 and int(calls) > limit:
                os.kill(os.getpid(), 9)
            return calls

        with tf.control_dependencies([tf.py_function(maybe_die, [self.calls], tf.int64)]):
            return tf.identity(x)


def killed_on_rank_1_in_epoch_1(input_shape, num_classes):
    """The MLP; rank 1's process is killed at its 31st training step, before the first checkpoint."""
    return tf.keras.Sequential([mlp(input_shape, num_classes), _KilledOnRank1After(30, _launcher_rank())],
                               name="test_killed_on_rank_1")


# ---- model objects, for --model package.module:name (hvdtrain.command_line_model) ---------------
def compiled_mlp():
    """A model object compiled as for Keras' fit (``import keras``: Keras 3, or Keras 2 on TF 2.15),
    its uint8 pixels scaled in the model."""
    import keras

    keras.utils.set_random_seed(int(os.environ.get("HVDTRAIN_TEST_SEED", "0")) + _launcher_rank())  # per rank
    model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Rescaling(1 / 255), keras.layers.Flatten(),
                              keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def token_classifier():
    """Token ids under a dict key in, two classes out, compiled."""
    import keras

    ids = keras.Input((12,), dtype="int32", name="ids")
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(50, 8)(ids))
    model = keras.Model({"ids": ids}, keras.layers.Dense(2)(pooled))
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def token_examples(split, rank, world_size, seed, epoch):
    """A data function of ``({"ids": (12,) int32}, label)`` examples: 101 train, 40 test."""
    import numpy as np

    n = 101 if split == "train" else 40
    ids = np.random.default_rng([seed, split == "train"]).integers(1, 50, size=(n, 12)).astype("int32")
    return tf.data.Dataset.from_tensor_slices(({"ids": ids}, (ids[:, 0] > 25).astype("int32")))


def returns_a_string():
    return "not a model"


def uncompiled_mlp():
    import keras

    return keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(), keras.layers.Dense(10)])
