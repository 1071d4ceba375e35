"""Models: the seed CNN, a CIFAR-style ResNet-20, a small U-Net, and users' own models named
``module:function``.

Every model maps float32 images ``(batch, H, W, C)`` scaled to [0, 1] to logits: ``(batch, K)``
for classification, ``(batch, H, W, K)`` per pixel for segmentation (``unet``).
"""
from __future__ import annotations

import sys
from typing import Callable, Optional, Tuple, Union

import tensorflow as tf

from hvdtrain.compat import require_keras2
from hvdtrain.errors import HvdtrainError, say
from hvdtrain.imports import import_function, name_of
from hvdtrain.model.convert import convert_sync_batchnorm, keras_batch_norm_layers
from hvdtrain.model.sync_bn import SyncBatchNormalization

BUILTIN_MODELS = ("cnn", "resnet20", "unet")


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


def unet(input_shape: Tuple[int, int, int], num_classes: int, norm: Optional[Norm] = None,
         filters: Tuple[int, ...] = (16, 32, 64), **_unused) -> tf.keras.Model:
    """A small U-Net: per-pixel logits ``(batch, H, W, K)``, batch norm after every convolution.

    Ronneberger, Fischer & Brox, "U-Net: Convolutional Networks for Biomedical Image
    Segmentation", MICCAI 2015, with "same" padding (outputs the size of the inputs) and batch
    norm: an encoder of (conv3x3-BN-ReLU) x2 then 2x2 max-pooling per level, and a decoder that
    upsamples (2x2 transposed convolution, stride 2), concatenates the encoder's features of that
    scale and applies (conv3x3-BN-ReLU) x2; a 1x1 convolution gives the logits. Segmentation is
    where synchronized batch norm matters most: local batches are small, and per-rank statistics
    of a few images are noisy.

    Args:
        input_shape: ``(H, W, C)``; H and W divisible by ``2 ** (len(filters) - 1)``.
        num_classes: logits per pixel.
        norm: applies each batch norm and the ReLU after it; default :func:`norm_factory` ``()``
            (synchronized).
        filters: channels per level, from the top.

    Raises:
        HvdtrainError: if H or W is not divisible by the total pooling factor.
    """
    norm = norm or norm_factory()
    factor = 2 ** (len(filters) - 1)
    if input_shape[0] % factor or input_shape[1] % factor:
        raise HvdtrainError(f"--model unet pools {len(filters) - 1} times: the images' height and width must be "
                            f"multiples of {factor}, got {input_shape[0]}x{input_shape[1]}")

    def block(x, channels):
        for _ in range(2):
            x = tf.keras.layers.Conv2D(channels, 3, padding="same", use_bias=False, kernel_initializer="he_normal")(x)
            x = norm(x, relu=True)
        return x

    inputs = tf.keras.Input(input_shape)
    x, skips = inputs, []
    for channels in filters[:-1]:
        x = block(x, channels)
        skips.append(x)
        x = tf.keras.layers.MaxPool2D()(x)
    x = block(x, filters[-1])
    for channels, skip in zip(reversed(filters[:-1]), reversed(skips)):
        x = tf.keras.layers.Conv2DTranspose(channels, 2, strides=2)(x)
        x = block(tf.keras.layers.Concatenate()([skip, x]), channels)
    outputs = tf.keras.layers.Conv2D(num_classes, 1)(x)
    return tf.keras.Model(inputs, outputs, name="unet")


def build_model(spec: Union[str, Callable], input_shape: Tuple[int, int, int], num_classes: int, sync_bn: bool = True,
                seed: int = 0, rank: int = 0, output_shape: Optional[Tuple[int, ...]] = None,
                outputs: str = "logits", convert_sync_bn: bool = False, world_size: int = 1) -> tf.keras.Model:
    """Build the model named by ``--model`` and check its output shape.

    Args:
        spec: ``"cnn"``, ``"resnet20"``, ``"unet"``, or a function (itself, or its
            ``"package.module:function"`` name) called as ``function(input_shape=(H, W, C),
            num_classes=K)`` that returns an
            uncompiled ``tf.keras.Model`` mapping ``(batch, H, W, C)`` float32 images in [0, 1]
            to ``(batch, *output_shape)`` outputs. (Use :class:`hvdtrain.SyncBatchNormalization`
            in it for synchronized batch statistics.)
        input_shape: ``(H, W, C)``.
        num_classes: ``K``.
        sync_bn: for built-in models, synchronized (True) or per-rank batch normalization.
        seed, rank: seed built-in models' dropout masks. With a model function, rank 0 warns (on
            stderr) if the model has Keras random layers (``Dropout``...), which resumes cannot repeat.
        output_shape: the outputs' shape per example that the labels need (default ``(K,)``).
        outputs: what they are, for the message of a wrong shape.
        convert_sync_bn: replace a model function's Keras batch norm layers by synchronized ones
            (:func:`hvdtrain.model.convert.convert_sync_batchnorm`). Without it, at ``world_size``
            > 1 rank 0 warns once of Keras batch norm layers, which normalize each rank's batch alone.

    Returns:
        The built ``tf.keras.Model``.

    Raises:
        HvdtrainError: for an unknown name, a module or function that cannot be imported, a
            function that does not return a Keras model or returns a Keras 3 one, or a model that
            fails on a batch of two images or does not return one ``(2, *output_shape)`` tensor for it.
    """
    if callable(spec):
        model = _user_model(spec, spec, input_shape, num_classes, rank)
        spec = name_of(spec)
    elif spec in BUILTIN_MODELS:
        build = {"cnn": seed_cnn, "resnet20": resnet20, "unet": unet}[spec]
        model = build(input_shape, num_classes, norm=norm_factory(sync_bn), seed=seed, rank=rank)
    else:
        model = _user_model(_import_model(spec), spec, input_shape, num_classes, rank)
    keras_norms = keras_batch_norm_layers(model)
    per_rank = [layer for layer in keras_norms if layer.trainable]  # frozen ones use moving statistics
    if keras_norms and convert_sync_bn:
        model = convert_sync_batchnorm(model)
    elif per_rank and world_size > 1 and rank == 0:
        say(f"hvdtrain: warning: --model {spec!r} has {len(per_rank)} Keras BatchNormalization layer(s) (e.g. "
            f"{per_rank[0].name!r}), which normalize each rank's batch alone: add --convert-sync-bn "
            f"(hvdtrain.fit(..., convert_sync_bn=True)) to normalize with the global batch's statistics", sys.stderr)
    # One inference call on two images (no collectives: synchronized BatchNorm uses its moving
    # statistics) checks what Keras' output_shape may not tell: subclassed models have none.
    try:
        out = model(tf.zeros((2, *input_shape)), training=False)
    except (Exception, SystemExit) as e:  # noqa: BLE001 -- the user's code
        first_line = (str(e).strip().splitlines() or [""])[0]
        raise HvdtrainError(f"--model {spec!r}: the model fails on a batch of (2, {', '.join(map(str, input_shape))}) "
                            f"images: {type(e).__name__}: {first_line}") from e
    expected = (2, *(output_shape if output_shape is not None else (num_classes,)))
    if not tf.is_tensor(out):
        raise HvdtrainError(f"--model {spec!r}: the model returns {type(out).__name__}, expected one {expected} "
                            f"tensor of {outputs} for 2 images")
    if tuple(out.shape) != expected:
        raise HvdtrainError(f"--model {spec!r}: the model outputs shape {tuple(out.shape)} for 2 images, expected "
                            f"{expected} {outputs}")
    return model


def _import_model(spec: str) -> Callable:
    """The function a ``package.module:function`` ``--model`` names."""
    if ":" not in spec:
        raise HvdtrainError(f"--model {spec!r}: unknown model; choose one of {BUILTIN_MODELS} or 'package.module:function'")
    if spec.startswith(":") or spec.endswith(":"):
        raise HvdtrainError(f"--model {spec!r}: expected one of {BUILTIN_MODELS} or 'package.module:function'")
    return import_function(spec, "--model")


def _user_model(fn: Callable, spec, input_shape: Tuple[int, int, int], num_classes: int, rank: int) -> tf.keras.Model:
    """The model of a user's model function ``fn`` (``spec``: it, or its name), built (see :func:`build_model`)."""
    spec = name_of(spec)
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
    random = sorted({type(m).__name__ for m in model.submodules
                     if isinstance(m, tf.keras.__internal__.layers.BaseRandomLayer)})
    if random and rank == 0:
        say(f"hvdtrain: warning: --model {spec!r} has Keras random layers ({', '.join(random)}), whose random "
            f"state is not among the model's variables: after --resume or an elastic reset their draws start "
            f"over, so the run no longer equals an uninterrupted one (hvdtrain.model.zoo.SeededDropout keeps "
            f"its state in the checkpoint)", sys.stderr)
    return model
