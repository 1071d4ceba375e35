"""Models: the seed CNN, a CIFAR-style ResNet-20, a small U-Net, and users' own models named
``module:function``.

Every model maps float32 images ``(batch, H, W, C)`` scaled to [0, 1] to logits: ``(batch, K)``
for classification, ``(batch, H, W, K)`` per pixel for segmentation (``unet``).
"""
from __future__ import annotations

import sys
from types import ModuleType
from typing import Callable, Optional, Tuple, Union

import tensorflow as tf

from hvdtrain import kerases
from hvdtrain.errors import HvdtrainError
from hvdtrain.console import say
from hvdtrain.user_code import import_function, name_of
from hvdtrain.model.convert import convert_sync_batchnorm, keras_batch_norm_layers
from hvdtrain.model.moving_statistics import sublayers
from hvdtrain.model.sync_bn import layer_class

BUILTIN_MODELS = ("cnn", "resnet20", "unet")


class SeededDropoutBase:
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
        self.calls = self.add_weight(name="calls", shape=(), dtype="int64", initializer="zeros", trainable=False)
        super().build(input_shape)

    def call(self, inputs, training=None):
        if not training or self.rate == 0.0:
            return inputs
        self.calls.assign_add(1)
        seed = tf.stack([tf.constant(self.seed * 1_000_003 + self.rank, tf.int64), tf.convert_to_tensor(self.calls)])
        keep = tf.random.stateless_uniform(tf.shape(inputs), seed=seed) >= self.rate
        return tf.where(keep, inputs / (1.0 - self.rate), tf.zeros_like(inputs))

    def get_config(self):
        return {**super().get_config(), "rate": self.rate, "seed": self.seed, "rank": self.rank}


def dropout_class(keras: ModuleType) -> type:
    """:class:`SeededDropoutBase` as a layer of ``keras`` (Keras 2 or 3), registered as
    ``hvdtrain>SeededDropout`` (:func:`hvdtrain.kerases.class_for`)."""
    return kerases.class_for(SeededDropoutBase, keras, "layers.Layer")


def __getattr__(name):
    if name == "SeededDropout":  # Keras 2's; hvdtrain.keras3.SeededDropout is Keras 3's
        return dropout_class(kerases.keras2())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def set_dropout_rank(model, rank: int) -> None:
    """Key the masks of every :class:`SeededDropout` in ``model`` by ``rank`` from now on.

    An elastic reset renumbers the ranks of the surviving and joining workers, while the model
    keeps the rank it was built with; without this, two workers could draw the same masks. Takes
    effect when the training step is next traced (hvdtrain traces a new one after every reset).

    Args:
        model: a Keras model; layers other than :class:`SeededDropout` are left alone.
        rank: int, this process's current rank.
    """
    for layer in sublayers(model):
        if isinstance(layer, SeededDropoutBase):
            layer.rank = int(rank)


Norm = Callable[..., tf.Tensor]
"""``norm(x, relu=False)``: a new batch norm layer applied to the Keras tensor ``x``, then a ReLU if ``relu``."""


def unfused_norm(make_layer: Callable) -> Norm:
    """A :data:`Norm` from a batch norm layer that cannot apply the ReLU itself: a ReLU layer (of
    the same Keras) follows it.

    Args:
        make_layer: returns a new batch norm layer, e.g. Keras' ``BatchNormalization``.
    """
    def norm(x, relu: bool = False):
        layer = make_layer()
        x = layer(x)
        return kerases.module(kerases.version_of(layer)).layers.ReLU()(x) if relu else x

    return norm


def norm_factory(sync_bn: bool = True, keras: Optional[ModuleType] = None) -> Norm:
    """Batch norm for the built-in models: hvdtrain's layer, synchronized or per-rank, momentum 0.9.

    Momentum 0.9 makes the moving statistics settle within ~50 steps, so evaluation is sound from
    the first epoch (Keras' default 0.99 needs ~500 steps). A ReLU after the batch norm is fused
    into the layer (``activation="relu"``). Per-rank batch norm (``sync_bn=False``) is the same
    layer with ``synchronized=False``, rather than Keras' ``BatchNormalization``: on the CPU its
    kernels are faster for the seed CNN and about as fast for ResNet-20
    (``benchmarks/bn_overhead.py``), and the two modes' models have the same layers, so a
    checkpoint of either resumes in the other. (Its moving variance is the biased one, Keras' fused
    layer's the unbiased: they differ by n/(n-1), n the examples times the positions per channel.)
    ``keras``: the Keras package of the layers (default Keras 2).
    """
    layer = layer_class(keras or kerases.keras2())

    def norm(x, relu: bool = False):
        return layer(momentum=0.9, activation="relu" if relu else None, synchronized=sync_bn)(x)

    return norm


def seed_cnn(input_shape: Tuple[int, int, int], num_classes: int, norm: Optional[Norm] = None,
             dropout: float = 0.25, seed: int = 0, rank: int = 0, keras: Optional[ModuleType] = None):
    """The seed CNN: (conv3x3-BN-ReLU-maxpool) x2 (32, 64 filters), dense(128)-BN-ReLU-dropout, dense.

    Args:
        input_shape: ``(H, W, C)``.
        num_classes: output logits.
        norm: applies each batch norm (and the ReLU after it); default :func:`norm_factory` ``()``
            (synchronized).
        dropout: dropout rate before the classifier.
        seed, rank: seed the dropout masks (see :class:`SeededDropoutBase`).
        keras: the Keras package to build with (default Keras 2; :mod:`hvdtrain.kerases`).
    """
    k = keras or kerases.keras2()
    norm = norm or norm_factory(keras=k)
    inputs = k.Input(input_shape)
    x = inputs
    for filters in (32, 64):
        x = k.layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
        x = norm(x, relu=True)
        x = k.layers.MaxPool2D()(x)
    x = k.layers.Flatten()(x)
    x = k.layers.Dense(128, use_bias=False)(x)
    x = norm(x, relu=True)
    if dropout:
        x = dropout_class(k)(dropout, seed=seed, rank=rank)(x)
    outputs = k.layers.Dense(num_classes)(x)
    return k.Model(inputs, outputs, name="seed_cnn")


def resnet20(input_shape: Tuple[int, int, int], num_classes: int, norm: Optional[Norm] = None,
             keras: Optional[ModuleType] = None, **_unused):
    """ResNet-20 for small images: 3 stages x 3 basic blocks (16, 32, 64 filters), global pool, dense.

    He, Zhang, Ren & Sun, "Deep Residual Learning for Image Recognition", CVPR 2016, §4.2 (n = 3),
    with 1x1 projection shortcuts where the shape changes.

    Args:
        input_shape: ``(H, W, C)``, e.g. ``(32, 32, 3)`` or ``(28, 28, 1)``.
        num_classes: output logits.
        norm: applies each batch norm (and the ReLU after it); default :func:`norm_factory` ``()``
            (synchronized).
        keras: the Keras package to build with (default Keras 2).
    """
    k = keras or kerases.keras2()
    norm = norm or norm_factory(keras=k)

    def conv(filters, kernel, strides=1):
        return k.layers.Conv2D(filters, kernel, strides, padding="same", use_bias=False, kernel_initializer="he_normal")

    inputs = k.Input(input_shape)
    x = norm(conv(16, 3)(inputs), relu=True)
    for stage, filters in enumerate((16, 32, 64)):
        for block in range(3):
            strides = 2 if stage > 0 and block == 0 else 1
            shortcut = x
            y = norm(conv(filters, 3, strides)(x), relu=True)
            y = norm(conv(filters, 3)(y))
            if strides != 1 or shortcut.shape[-1] != filters:
                shortcut = norm(conv(filters, 1, strides)(shortcut))
            x = k.layers.ReLU()(k.layers.Add()([shortcut, y]))
    x = k.layers.GlobalAveragePooling2D()(x)
    outputs = k.layers.Dense(num_classes)(x)
    return k.Model(inputs, outputs, name="resnet20")


def unet(input_shape: Tuple[int, int, int], num_classes: int, norm: Optional[Norm] = None,
         filters: Tuple[int, ...] = (16, 32, 64), keras: Optional[ModuleType] = None, **_unused):
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
        keras: the Keras package to build with (default Keras 2).

    Raises:
        HvdtrainError: if H or W is not divisible by the total pooling factor.
    """
    k = keras or kerases.keras2()
    norm = norm or norm_factory(keras=k)
    factor = 2 ** (len(filters) - 1)
    if input_shape[0] % factor or input_shape[1] % factor:
        raise HvdtrainError(f"--model unet pools {len(filters) - 1} times: the images' height and width must be "
                            f"multiples of {factor}, got {input_shape[0]}x{input_shape[1]}")

    def block(x, channels):
        for _ in range(2):
            x = k.layers.Conv2D(channels, 3, padding="same", use_bias=False, kernel_initializer="he_normal")(x)
            x = norm(x, relu=True)
        return x

    inputs = k.Input(input_shape)
    x, skips = inputs, []
    for channels in filters[:-1]:
        x = block(x, channels)
        skips.append(x)
        x = k.layers.MaxPool2D()(x)
    x = block(x, filters[-1])
    for channels, skip in zip(reversed(filters[:-1]), reversed(skips)):
        x = k.layers.Conv2DTranspose(channels, 2, strides=2)(x)
        x = block(k.layers.Concatenate()([skip, x]), channels)
    outputs = k.layers.Conv2D(num_classes, 1)(x)
    return k.Model(inputs, outputs, name="unet")


def build_model(spec: Union[str, Callable], input_shape: Tuple[int, int, int], num_classes: int, sync_bn: bool = True,
                seed: int = 0, rank: int = 0, output_shape: Optional[Tuple[int, ...]] = None,
                outputs: str = "logits", convert_sync_bn: bool = False, world_size: int = 1, keras: int = 0):
    """Build the model named by ``--model`` and check its output shape.

    Args:
        spec: ``"cnn"``, ``"resnet20"``, ``"unet"``, or a function (itself, or its
            ``"package.module:function"`` name) called as ``function(input_shape=(H, W, C),
            num_classes=K)`` that returns an
            uncompiled Keras model (Keras 2 or 3) mapping ``(batch, H, W, C)`` float32 images in
            [0, 1] to ``(batch, *output_shape)`` outputs. (Use the ``SyncBatchNormalization`` of its
            Keras, ``hvdtrain.keras2``'s or ``hvdtrain.keras3``'s, for synchronized batch statistics.)
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
        keras: ``--keras``: the Keras of the built-in models, 2 or 3 (0: TensorFlow's default); a
            model function's model must be of it where given.

    Returns:
        The built Keras model.

    Raises:
        HvdtrainError: for an unknown name, a module or function that cannot be imported, a
            function that does not return a Keras model (or one of another Keras than ``keras``,
            or of both), or a model that fails on a batch of two images or does not return one
            ``(2, *output_shape)`` tensor for it.
    """
    if callable(spec):
        model = _user_model(spec, spec, input_shape, num_classes, rank, keras)
        spec = name_of(spec)
    elif spec in BUILTIN_MODELS:
        build = {"cnn": seed_cnn, "resnet20": resnet20, "unet": unet}[spec]
        k = kerases.module(kerases.choose(keras))
        model = build(input_shape, num_classes, norm=norm_factory(sync_bn, k), seed=seed, rank=rank, keras=k)
    else:
        model = _user_model(_import_model(spec), spec, input_shape, num_classes, rank, keras)
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


def _user_model(fn: Callable, spec, input_shape: Tuple[int, int, int], num_classes: int, rank: int, keras: int = 0):
    """The model of a user's model function ``fn`` (``spec``: it, or its name), built (see :func:`build_model`)."""
    spec = name_of(spec)
    try:
        model = fn(input_shape=tuple(input_shape), num_classes=num_classes)
    except HvdtrainError:
        raise
    except (Exception, SystemExit) as e:  # noqa: BLE001 -- the user's code (even a sys.exit): report it as theirs
        raise HvdtrainError(f"--model {spec!r}: the function raised {type(e).__name__}: {e}") from e
    version = kerases.version_of(model)
    if version is None or not isinstance(model, kerases.module(version).Model):
        raise HvdtrainError(f"--model {spec!r}: the function returned {type(model).__name__}, not a Keras model")
    kerases.choose(keras, model=model)  # one Keras in the model, and --keras's
    if not model.built:  # a subclassed or Input-less model: create its weights for this input shape
        try:
            model.build((None, *input_shape))
        except (Exception, SystemExit) as e:  # noqa: BLE001 -- the user's code
            raise HvdtrainError(f"--model {spec!r}: cannot build the model for inputs (None, "
                                f"{', '.join(map(str, input_shape))}): {type(e).__name__}: {e}") from e
    random = sorted({type(m).__name__ for m in sublayers(model) if _keeps_random_state_apart(m)})
    if random and rank == 0:
        say(f"hvdtrain: warning: --model {spec!r} has Keras random layers ({', '.join(random)}), whose random "
            f"state is not among the model's variables: after --resume or an elastic reset their draws start "
            f"over, so the run no longer equals an uninterrupted one (hvdtrain.model.zoo.SeededDropout keeps "
            f"its state in the checkpoint)", sys.stderr)
    return model


def _keeps_random_state_apart(layer) -> bool:
    """A Keras 2 random layer (``Dropout``...), whose random generator's state is no variable of
    the model. (Keras 3's random layers keep theirs in a seed generator's variable, checkpointed.)"""
    return kerases.version_of(layer) == 2 and isinstance(layer, kerases.keras2().__internal__.layers.BaseRandomLayer)
