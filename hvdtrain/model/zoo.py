"""Models: the seed CNN, a CIFAR-style ResNet-20, and users' own models named ``module:function``.

Every model maps float32 images ``(batch, H, W, C)`` scaled to [0, 1] to logits ``(batch, classes)``.
"""
from __future__ import annotations

import sys
from typing import Callable, Optional, Tuple

import tensorflow as tf

from hvdtrain.compat import require_keras2
from hvdtrain.errors import HvdtrainError, say
from hvdtrain.imports import import_function
from hvdtrain.model.sync_bn import SyncBatchNormalization

BUILTIN_MODELS = ("cnn", "resnet20")


@tf.keras.utils.register_keras_serializable(package="hvdtrain")
class SeededDropout(tf.keras.layers.Layer):
    """Dropout whose masks are a pure function of (seed, rank, call count), so a resumed run repeats them.

    The call count is a non-trainable int64 weight saved in checkpoints; ``rank`` makes the masks
    of different ranks independent (each rank sees different examples).

    Args:
        rate: float in [0, 1), fraction of units dropped in training.
        seed: int, run seed.
        rank: int, the rank whose mask stream this layer draws: this process's rank. After an
            elastic reset renumbers the ranks, :func:`set_dropout_rank` updates it; a step traced
            before that keeps the old rank, so hvdtrain traces a new step after every reset.

    Call arguments:
        inputs: float tensor of any shape.
        training: drop units only when True.

    Raises:
        ValueError: for ``rate`` outside [0, 1).
    """

    def __init__(self, rate: float, seed: int = 0, rank: int = 0, **kwargs):
        super().__init__(**kwargs)
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"dropout rate must be in [0, 1), got {rate!r}")
        self.rate, self.seed, self.rank = float(rate), int(seed), int(rank)

    def build(self, input_shape):
        self.calls = self.add_weight(name="calls", shape=(), dtype=tf.int64, initializer="zeros", trainable=False)
        super().build(input_shape)

    def call(self, inputs, training=None):
        if not training or self.rate == 0.0:
            return inputs
        self.calls.assign_add(1)
        seed = tf.stack([tf.constant(self.seed * 1_000_003 + self.rank, tf.int64), self.calls.read_value()])
        keep = tf.random.stateless_uniform(tf.shape(inputs), seed=seed) >= self.rate
        return tf.where(keep, inputs / (1.0 - self.rate), tf.zeros_like(inputs))

    def get_config(self):
        return {**super().get_config(), "rate": self.rate, "seed": self.seed, "rank": self.rank}


def set_dropout_rank(model: tf.keras.Model, rank: int) -> None:
    """Key the masks of every :class:`SeededDropout` in ``model`` by ``rank`` from now on.

    An elastic reset renumbers the ranks of the surviving and joining workers, while the model
    keeps the rank it was built with; without this, two workers could draw the same masks. Takes
    effect when the training step is next traced (hvdtrain traces a new one after every reset).

    Args:
        model: a Keras model; layers other than :class:`SeededDropout` are left alone.
        rank: int, this process's current rank.
    """
    for layer in model.submodules:
        if isinstance(layer, SeededDropout):
            layer.rank = int(rank)


Norm = Callable[..., tf.Tensor]
"""``norm(x, relu=False)``: a new batch norm layer applied to the Keras tensor ``x``, then a ReLU if ``relu``."""


def unfused_norm(make_layer: Callable[[], tf.keras.layers.Layer]) -> Norm:
    """A :data:`Norm` from a batch norm layer that cannot apply the ReLU itself: a ReLU layer follows it.

    Args:
        make_layer: returns a new batch norm layer, e.g. ``tf.keras.layers.BatchNormalization``.
    """
    def norm(x, relu: bool = False):
        x = make_layer()(x)
        return tf.keras.layers.ReLU()(x) if relu else x

    return norm


def norm_factory(sync_bn: bool = True) -> Norm:
    """Batch norm for the built-in models: hvdtrain's layer, synchronized or per-rank, momentum 0.9.

    Momentum 0.9 makes the moving statistics settle within ~50 steps, so evaluation is sound from
    the first epoch (Keras' default 0.99 needs ~500 steps). A ReLU after the batch norm is fused
    into the layer (``activation="relu"``). Per-rank batch norm (``sync_bn=False``) is the same
    layer with ``synchronized=False``, rather than Keras' ``BatchNormalization``: on the CPU its
    kernels are faster for the seed CNN and about as fast for ResNet-20
    (``benchmarks/bn_overhead.py``), and the two modes' models have the same layers, so a
    checkpoint of either resumes in the other. (Its moving variance is the biased one, Keras' fused
    layer's the unbiased: they differ by n/(n-1), n the examples times the positions per channel.)
    """
    def norm(x, relu: bool = False):
        return SyncBatchNormalization(momentum=0.9, activation="relu" if relu else None, synchronized=sync_bn)(x)

    return norm


def seed_cnn(input_shape: Tuple[int, int, int], num_classes: int, norm: Optional[Norm] = None,
             dropout: float = 0.25, seed: int = 0, rank: int = 0) -> tf.keras.Model:
    """The seed CNN: (conv3x3-BN-ReLU-maxpool) x2 (32, 64 filters), dense(128)-BN-ReLU-dropout, dense.

    Args:
        input_shape: ``(H, W, C)``.
        num_classes: output logits.
        norm: applies each batch norm (and the ReLU after it); default :func:`norm_factory` ``()``
            (synchronized).
        dropout: dropout rate before the classifier.
        seed, rank: seed the dropout masks (see :class:`SeededDropout`).
    """
    norm = norm or norm_factory()
    inputs = tf.keras.Input(input_shape)
    x = inputs
    for filters in (32, 64):
        x = tf.keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
        x = norm(x, relu=True)
        x = tf.keras.layers.MaxPool2D()(x)
    x = tf.keras.layers.Flatten()(x)
    x = tf.keras.layers.Dense(128, use_bias=False)(x)
    x = norm(x, relu=True)
    if dropout:
        x = SeededDropout(dropout, seed=seed, rank=rank)(x)
    outputs = tf.keras.layers.Dense(num_classes)(x)
    return tf.keras.Model(inputs, outputs, name="seed_cnn")


def resnet20(input_shape: Tuple[int, int, int], num_classes: int, norm: Optional[Norm] = None,
             **_unused) -> tf.keras.Model:
    """ResNet-20 for small images: 3 stages x 3 basic blocks (16, 32, 64 filters), global pool, dense.

    He, Zhang, Ren & Sun, "Deep Residual Learning for Image Recognition", CVPR 2016, §4.2 (n = 3),
    with 1x1 projection shortcuts where the shape changes.

    Args:
        input_shape: ``(H, W, C)``, e.g. ``(32, 32, 3)`` or ``(28, 28, 1)``.
        num_classes: output logits.
        norm: applies each batch norm (and the ReLU after it); default :func:`norm_factory` ``()``
            (synchronized).
    """
    norm = norm or norm_factory()

    def conv(filters, kernel, strides=1):
        return tf.keras.layers.Conv2D(filters, kernel, strides, padding="same", use_bias=False,
                                      kernel_initializer="he_normal")

    inputs = tf.keras.Input(input_shape)
    x = norm(conv(16, 3)(inputs), relu=True)
    for stage, filters in enumerate((16, 32, 64)):
        for block in range(3):
            strides = 2 if stage > 0 and block == 0 else 1
            shortcut = x
            y = norm(conv(filters, 3, strides)(x), relu=True)
            y = norm(conv(filters, 3)(y))
            if strides != 1 or shortcut.shape[-1] != filters:
                shortcut = norm(conv(filters, 1, strides)(shortcut))
            x = tf.keras.layers.ReLU()(tf.keras.layers.Add()([shortcut, y]))
    x = tf.keras.layers.GlobalAveragePooling2D()(x)
    outputs = tf.keras.layers.Dense(num_classes)(x)
    return tf.keras.Model(inputs, outputs, name="resnet20")


def build_model(spec: str, input_shape: Tuple[int, int, int], num_classes: int, sync_bn: bool = True,
                seed: int = 0, rank: int = 0) -> tf.keras.Model:
    """Build the model named by ``--model``.

    Args:
        spec: ``"cnn"``, ``"resnet20"``, or ``"package.module:function"`` naming a function called
            as ``function(input_shape=(H, W, C), num_classes=K)`` that returns an uncompiled
            ``tf.keras.Model`` mapping ``(batch, H, W, C)`` float32 images in [0, 1] to
            ``(batch, K)`` logits. (Use :class:`hvdtrain.SyncBatchNormalization` in it for
            synchronized batch statistics.)
        input_shape: ``(H, W, C)``.
        num_classes: ``K``.
        sync_bn: for built-in models, synchronized (True) or per-rank batch normalization.
        seed, rank: seed built-in models' dropout masks. With a model function, rank 0 warns (on
            stderr) if the model has Keras random layers (``Dropout``...), which resumes cannot repeat.

    Returns:
        The built ``tf.keras.Model``.

    Raises:
        HvdtrainError: for an unknown name, a module or function that cannot be imported, a
            function that does not return a Keras model or returns a Keras 3 one, or a model that fails on a batch of two
            images or does not return one ``(2, K)`` tensor for it.
    """
    if spec == "cnn":
        return seed_cnn(input_shape, num_classes, norm=norm_factory(sync_bn), seed=seed, rank=rank)
    if spec == "resnet20":
        return resnet20(input_shape, num_classes, norm=norm_factory(sync_bn))
    if ":" not in spec:
        raise HvdtrainError(f"--model {spec!r}: unknown model; choose one of {BUILTIN_MODELS} or 'package.module:function'")
    if spec.startswith(":") or spec.endswith(":"):
        raise HvdtrainError(f"--model {spec!r}: expected one of {BUILTIN_MODELS} or 'package.module:function'")
    fn = import_function(spec, "--model")
    try:
        model = fn(input_shape=tuple(input_shape), num_classes=num_classes)
    except HvdtrainError:
        raise
    except (Exception, SystemExit) as e:  # noqa: BLE001 -- the user's code (even a sys.exit): report it as theirs
        raise HvdtrainError(f"--model {spec!r}: the function raised {type(e).__name__}: {e}") from e
    require_keras2(model)  # a Keras 3 model: its gradients would not be averaged
    if not isinstance(model, tf.keras.Model):
        raise HvdtrainError(f"--model {spec!r}: the function returned {type(model).__name__}, not a tf.keras.Model")
    if not model.built:  # a subclassed or Input-less model: create its weights for this input shape
        try:
            model.build((None, *input_shape))
        except (Exception, SystemExit) as e:  # noqa: BLE001 -- the user's code
            raise HvdtrainError(f"--model {spec!r}: cannot build the model for inputs (None, "
                                f"{', '.join(map(str, input_shape))}): {type(e).__name__}: {e}") from e
    # One inference call on two images (no collectives: synchronized BatchNorm uses its moving
    # statistics) checks what Keras' output_shape may not tell: subclassed models have none.
    try:
        out = model(tf.zeros((2, *input_shape)), training=False)
    except (Exception, SystemExit) as e:  # noqa: BLE001 -- the user's code
        first_line = (str(e).strip().splitlines() or [""])[0]
        raise HvdtrainError(f"--model {spec!r}: the model fails on a batch of (2, {', '.join(map(str, input_shape))}) "
                            f"images: {type(e).__name__}: {first_line}") from e
    if not tf.is_tensor(out):
        raise HvdtrainError(f"--model {spec!r}: the model returns {type(out).__name__}, expected one (batch, "
                            f"{num_classes}) tensor of logits")
    out_shape = tuple(out.shape)
    if out_shape != (2, num_classes):
        raise HvdtrainError(f"--model {spec!r}: the model outputs shape {out_shape} for 2 images, expected "
                            f"(2, {num_classes}) logits")
    random = sorted({type(m).__name__ for m in model.submodules
                     if isinstance(m, tf.keras.__internal__.layers.BaseRandomLayer)})
    if random and rank == 0:
        say(f"hvdtrain: warning: --model {spec!r} has Keras random layers ({', '.join(random)}), whose random "
            f"state is not among the model's variables: after --resume or an elastic reset their draws start "
            f"over, so the run no longer equals an uninterrupted one (hvdtrain.model.zoo.SeededDropout keeps "
            f"its state in the checkpoint)", sys.stderr)
    return model
