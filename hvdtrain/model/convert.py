"""Convert a model's Keras batch norm layers to synchronized BatchNorm: :func:`convert_sync_batchnorm`."""
from __future__ import annotations

import functools
from types import ModuleType
from typing import Dict

import numpy as np

from hvdtrain import kerases
from hvdtrain.errors import HvdtrainError
from hvdtrain.model.moving_statistics import keras_batch_norms, sublayers
from hvdtrain.model.sync_bn import layer_class

# Keras arguments whose meaning SyncBatchNormalization does not implement, with their neutral values.
_UNSUPPORTED = {"renorm": False, "adjustment": None}


def is_keras_batch_norm(layer) -> bool:
    """Whether ``layer`` is Keras' own batch norm (``BatchNormalization``, with or without
    ``synchronized=True``, or ``experimental.SyncBatchNormalization``): under Horovod each
    normalizes its own rank's batch."""
    return isinstance(layer, keras_batch_norms())


def is_converted(layer) -> bool:
    """Whether :func:`convert_sync_batchnorm` replaces ``layer``: a Keras batch norm layer, except
    one of virtual ("ghost") batches, groups of its rank's own examples, which it leaves as it is
    (where they divide the local batch, each rank's are those of one process on the global batch)."""
    return is_keras_batch_norm(layer) and getattr(layer, "virtual_batch_size", None) is None


def keras_batch_norm_layers(model) -> list:
    """The Keras batch norm layers in ``model``, nested ones included, each once."""
    return [m for m in sublayers(model) if is_keras_batch_norm(m)] + ([model] if is_keras_batch_norm(model) else [])


def convert_sync_batchnorm(model):
    """``model`` with every Keras batch norm layer replaced by hvdtrain's synchronized layer of the
    same Keras (``hvdtrain.keras2.SyncBatchNormalization``, ``hvdtrain.keras3.SyncBatchNormalization``)
    and the same configuration and weights: what PyTorch's ``SyncBatchNorm.convert_sync_batchnorm``
    does for ``torch.nn.BatchNorm*d``.

    Sequential and functional models (``keras.applications`` models among them) are cloned with
    Keras' ``clone_model``: the returned model is new, and shares every other layer (and its
    weights) with ``model``. Subclassed models, and custom layers that hold batch norm layers,
    are converted in place: each batch norm layer held in an attribute, or in a list or dict
    attribute, is replaced. Nested models are converted alike, at any depth. (A Keras 3 subclassed
    model's own ``tf.train.Checkpoint`` edges keep naming the replaced layers; hvdtrain's
    checkpoints list every variable of a Keras 3 model, so they save and restore the new ones.)

    Each new layer takes the old one's ``get_config()`` (axis, momentum, epsilon, center, scale,
    initializers, regularizers, constraints, name, dtype policy, trainable) and, if the old one was
    built, its gamma, beta, moving mean and moving variance. Where a built Keras layer uses its
    fused kernel (4-D inputs), which tracks the unbiased batch variance, the new layer does too
    (``unbiased_moving_variance=True``), so the moving statistics mean what they meant (a layer
    never built has not chosen its kernel yet: its copy tracks the biased variance). A layer held
    in two places stays one layer.
    ``fused`` and Keras' own ``synchronized`` flag are dropped: Keras' synchronization needs a
    ``tf.distribute`` strategy and does nothing under Horovod. A layer with ``virtual_batch_size``
    stays Keras' (:func:`is_converted`).

    Args:
        model: a Keras 2 model (``tf.keras`` after ``import hvdtrain``, or ``tf_keras``) or a Keras 3
            one (``import keras``, TensorFlow backend).

    Returns:
        The converted model: a new one for Sequential and functional models, ``model`` itself for
        subclassed ones; ``model`` unchanged if it has no Keras batch norm layer.

    Raises:
        HvdtrainError: for anything but a Keras model; naming the layer, for a batch norm layer
            with ``renorm`` or ``adjustment`` (which the synchronized layer does not implement), or one that cannot be replaced (created inside ``call``, or held
            somewhere other than an attribute, list or dict of a layer).
    """
    version = kerases.version_of(model)
    keras = kerases.module(version) if version else None
    if keras is None or not isinstance(model, keras.Model):
        raise HvdtrainError(f"convert_sync_batchnorm takes a Keras model, got {type(model).__name__}")
    kerases.choose(version, model=model)  # one Keras throughout
    converted = _converted(model, {}, keras)
    left = [layer for layer in keras_batch_norm_layers(converted) if is_converted(layer)]
    if left:
        raise HvdtrainError(f"convert_sync_batchnorm: cannot replace the batch norm layer {left[0].name!r} of "
                            f"{model.name!r}: it is not held in an attribute, list or dict of a layer (made inside "
                            f"call?); use hvdtrain's SyncBatchNormalization in the model's code instead")
    return converted


def synchronized_copy(layer, keras: ModuleType):
    """hvdtrain's ``SyncBatchNormalization`` of ``keras`` with ``layer``'s configuration and, if
    built, its weights.

    Raises:
        HvdtrainError: naming the layer and the argument, for ``renorm`` or ``adjustment``.
    """
    config = layer.get_config()
    for argument, neutral in _UNSUPPORTED.items():
        if config.get(argument, neutral) != neutral or getattr(layer, argument, neutral) != neutral:
            raise HvdtrainError(f"convert_sync_batchnorm: the layer {layer.name!r} uses {argument}="
                                f"{getattr(layer, argument, config.get(argument))!r}, which "
                                f"SyncBatchNormalization does not implement")
    config = {key: value for key, value in config.items()
              if key not in ("fused", "synchronized", "renorm_clipping", "renorm_momentum", *_UNSUPPORTED)}
    config["unbiased_moving_variance"] = bool(getattr(layer, "fused", False))  # Keras' fused kernel's variance
    new = layer_class(keras).from_config(config)
    if layer.built:
        new.build(_input_shape(layer))
        copy_weights(layer, new)
    return new


def copy_weights(layer, new) -> None:
    """``layer``'s gamma, beta, moving mean and variance into ``new`` (Keras keeps several axes'
    weights with 1s between them, e.g. ``(1, 5, 1, 7)``, where the new layer's are ``(5, 7)``)."""
    new.set_weights([np.reshape(w, v.shape) for w, v in zip(layer.get_weights(), new.weights)])


def _input_shape(layer) -> list:
    """A shape the built batch norm ``layer`` was built for: its rank, with its channel axes known."""
    spec = layer.input_spec
    spec = spec[0] if isinstance(spec, (list, tuple)) else spec
    shape = [None] * spec.ndim
    for axis, dim in (spec.axes or {}).items():
        shape[axis] = dim
    return shape


def _has_batch_norm(layer) -> bool:
    return bool(keras_batch_norm_layers(layer))


def _is_graph(model, keras: ModuleType) -> bool:
    """A Sequential or functional model, a subclass of a functional one included (Keras 3 makes a
    ``keras.Model`` subclass called with inputs and outputs a ``Functional``): ``clone_model``
    rebuilds it; its graph would keep calling replaced layers."""
    return isinstance(model, keras.Sequential) or bool(getattr(model, "_is_graph_network", False)) \
        or any(cls.__name__ == "Functional" for cls in type(model).__mro__)


def _converted(model, memo: Dict[int, object], keras: ModuleType):
    """``model`` converted: cloned if it is a graph (Sequential, functional), else in place.
    ``memo`` maps each layer converted so far (by ``id``) to its replacement, so that a layer held
    in two places stays one layer."""
    if not _has_batch_norm(model):
        return model
    if not _is_graph(model, keras):
        _convert_attributes(model, memo, keras)
        return model
    # Other layers are shared with the original model, weights and all.
    return keras.models.clone_model(model, clone_function=lambda layer: _replacement(layer, memo, keras))


def _replacement(layer, memo: Dict[int, object], keras: ModuleType):
    """What ``layer`` becomes: a synchronized copy of a batch norm layer, a converted model, or
    itself (a custom layer holding batch norm layers converted in place)."""
    if id(layer) in memo:
        return memo[id(layer)]
    if is_converted(layer):
        memo[id(layer)] = synchronized_copy(layer, keras)
    elif isinstance(layer, keras.Model):
        memo[id(layer)] = _converted(layer, memo, keras)
    else:
        if isinstance(layer, keras.layers.Layer) and _has_batch_norm(layer):
            _convert_attributes(layer, memo, keras)
        memo[id(layer)] = layer
    return memo[id(layer)]


@functools.lru_cache(maxsize=None)
def _keras_internals(keras: ModuleType) -> frozenset:
    """Attribute names of Keras' own bookkeeping (its lists of tracked layers...), left alone."""
    return frozenset(vars(keras.Model())) | frozenset(vars(keras.layers.Layer()))


def _retrack(owner, old, new) -> None:
    """Keras 3 keeps the layers a layer holds in a list of its own (``_layers``), filled when an
    attribute is set and locked once the layer is built: swap ``old`` for ``new`` there too."""
    tracked = getattr(owner, "_layers", None)
    if isinstance(tracked, list):
        for i, layer in enumerate(tracked):
            if layer is old:
                tracked[i] = new


def _convert_attributes(layer, memo: Dict[int, object], keras: ModuleType) -> None:
    """Replace, in place, the batch norm layers held in ``layer``'s attributes (and in its list
    and dict attributes), converting nested layers and models on the way."""
    keras3 = kerases.version_of(keras.layers.Layer) == 3
    for name, value in list(vars(layer).items()):
        if name in _keras_internals(keras):
            continue
        if isinstance(value, keras.layers.Layer):
            new = _replacement(value, memo, keras)
            if new is not value:
                if keras3:  # past Keras 3's tracking, which refuses new layers once built
                    object.__setattr__(layer, name, new)
                    _retrack(layer, value, new)  # (TensorFlow's checkpoint edge keeps the old layer:
                    # hvdtrain's checkpoints list a Keras 3 model's variables themselves)
                else:
                    setattr(layer, name, new)
        elif isinstance(value, list):  # Keras' ListWrapper, TrackedList too
            for i, item in enumerate(value):
                new = _replacement(item, memo, keras) if isinstance(item, keras.layers.Layer) else item
                if new is not item and keras3:
                    list.__setitem__(value, i, new)
                    _retrack(layer, item, new)
                elif new is not item:
                    value[i] = new
        elif hasattr(value, "items") and hasattr(value, "__setitem__"):  # dict, Keras' _DictWrapper, TrackedDict
            for key, item in list(value.items()):
                new = _replacement(item, memo, keras) if isinstance(item, keras.layers.Layer) else item
                if new is not item and keras3:
                    dict.__setitem__(value, key, new)
                    _retrack(layer, item, new)
                elif new is not item:
                    value[key] = new
