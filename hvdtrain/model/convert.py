"""Convert a model's Keras batch norm layers to synchronized BatchNorm: :func:`convert_sync_batchnorm`."""
from __future__ import annotations

import functools
from typing import Dict, List

import numpy as np
import tensorflow as tf

from hvdtrain.compat import require_keras2
from hvdtrain.errors import HvdtrainError
from hvdtrain.model.moving_statistics import keras_batch_norms
from hvdtrain.model.sync_bn import SyncBatchNormalization

# Keras arguments whose meaning SyncBatchNormalization does not implement, with their neutral values.
_UNSUPPORTED = {"renorm": False, "virtual_batch_size": None, "adjustment": None}


def is_keras_batch_norm(layer) -> bool:
    """Whether ``layer`` is Keras' own batch norm (``BatchNormalization``, with or without
    ``synchronized=True``, or ``experimental.SyncBatchNormalization``): under Horovod each
    normalizes its own rank's batch."""
    return isinstance(layer, keras_batch_norms())


def keras_batch_norm_layers(model: tf.Module) -> List[tf.keras.layers.Layer]:
    """The Keras batch norm layers in ``model``, nested ones included, each once."""
    return [m for m in model.submodules if is_keras_batch_norm(m)] + ([model] if is_keras_batch_norm(model) else [])


def convert_sync_batchnorm(model: tf.keras.Model) -> tf.keras.Model:
    """``model`` with every Keras batch norm layer replaced by :class:`~hvdtrain.SyncBatchNormalization`
    of the same configuration and weights: what PyTorch's ``SyncBatchNorm.convert_sync_batchnorm``
    does for ``torch.nn.BatchNorm*d``.

    Sequential and functional models (``keras.applications`` models among them) are cloned with
    ``tf.keras.models.clone_model``: the returned model is new, and shares every other layer (and
    its weights) with ``model``. Subclassed models, and custom layers that hold batch norm layers,
    are converted in place: each batch norm layer held in an attribute, or in a list or dict
    attribute, is replaced. Nested models are converted alike, at any depth.

    Each new layer takes the old one's ``get_config()`` (axis, momentum, epsilon, center, scale,
    initializers, regularizers, constraints, name, dtype policy, trainable) and, if the old one was
    built, its gamma, beta, moving mean and moving variance. Where a built Keras layer uses its
    fused kernel (4-D inputs), which tracks the unbiased batch variance, the new layer does too
    (``unbiased_moving_variance=True``), so the moving statistics mean what they meant (a layer
    never built has not chosen its kernel yet: its copy tracks the biased variance). A layer held
    in two places stays one layer.
    ``fused`` and Keras' own ``synchronized`` flag are dropped: Keras' synchronization needs a
    ``tf.distribute`` strategy and does nothing under Horovod.

    Args:
        model: a ``tf.keras.Model`` (Keras 2: ``tf.keras`` after ``import hvdtrain``, or ``tf_keras``).

    Returns:
        The converted model: a new one for Sequential and functional models, ``model`` itself for
        subclassed ones; ``model`` unchanged if it has no Keras batch norm layer.

    Raises:
        HvdtrainError: for anything but a Keras 2 model; naming the layer, for a batch norm layer
            with ``renorm``, ``virtual_batch_size`` or ``adjustment`` (which the synchronized layer
            does not implement), or one that cannot be replaced (created inside ``call``, or held
            somewhere other than an attribute, list or dict of a layer).
    """
    require_keras2(model)
    if not isinstance(model, tf.keras.Model):
        raise HvdtrainError(f"convert_sync_batchnorm takes a tf.keras.Model, got {type(model).__name__}")
    converted = _converted(model, {})
    left = keras_batch_norm_layers(converted)
    if left:
        raise HvdtrainError(f"convert_sync_batchnorm: cannot replace the batch norm layer {left[0].name!r} of "
                            f"{model.name!r}: it is not held in an attribute, list or dict of a layer (made inside "
                            f"call?); use hvdtrain.SyncBatchNormalization in the model's code instead")
    return converted


def synchronized_copy(layer: tf.keras.layers.Layer) -> SyncBatchNormalization:
    """A :class:`SyncBatchNormalization` with ``layer``'s configuration and, if built, its weights.

    Raises:
        HvdtrainError: naming the layer and the argument, for ``renorm``, ``virtual_batch_size``
            or ``adjustment``.
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
    new = SyncBatchNormalization.from_config(config)
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


def _converted(model: tf.keras.Model, memo: Dict[int, object]) -> tf.keras.Model:
    """``model`` converted: cloned if it is a graph (Sequential, functional), else in place.
    ``memo`` maps each layer converted so far (by ``id``) to its replacement, so that a layer held
    in two places stays one layer."""
    if not _has_batch_norm(model):
        return model
    if not getattr(model, "_is_graph_network", False) and not isinstance(model, tf.keras.Sequential):
        _convert_attributes(model, memo)
        return model
    # Other layers are shared with the original model, weights and all.
    return tf.keras.models.clone_model(model, clone_function=lambda layer: _replacement(layer, memo))


def _replacement(layer, memo: Dict[int, object]):
    """What ``layer`` becomes: a synchronized copy of a batch norm layer, a converted model, or
    itself (a custom layer holding batch norm layers converted in place)."""
    if id(layer) in memo:
        return memo[id(layer)]
    if is_keras_batch_norm(layer):
        memo[id(layer)] = synchronized_copy(layer)
    elif isinstance(layer, tf.keras.Model):
        memo[id(layer)] = _converted(layer, memo)
    else:
        if isinstance(layer, tf.keras.layers.Layer) and _has_batch_norm(layer):
            _convert_attributes(layer, memo)
        memo[id(layer)] = layer
    return memo[id(layer)]


@functools.lru_cache(maxsize=None)
def _keras_internals() -> frozenset:
    """Attribute names of Keras' own bookkeeping (its lists of tracked layers...), left alone."""
    return frozenset(vars(tf.keras.Model())) | frozenset(vars(tf.keras.layers.Layer()))


def _convert_attributes(layer, memo: Dict[int, object]) -> None:
    """Replace, in place, the batch norm layers held in ``layer``'s attributes (and in its list
    and dict attributes), converting nested layers and models on the way."""
    for name, value in list(vars(layer).items()):
        if name in _keras_internals():
            continue
        if isinstance(value, tf.keras.layers.Layer):
            new = _replacement(value, memo)
            if new is not value:
                setattr(layer, name, new)
        elif isinstance(value, list):  # Keras' ListWrapper too
            for i, item in enumerate(value):
                new = _replacement(item, memo) if isinstance(item, tf.keras.layers.Layer) else item
                if new is not item:
                    value[i] = new
        elif hasattr(value, "items") and hasattr(value, "__setitem__"):  # dict, Keras' _DictWrapper
            for key, item in list(value.items()):
                new = _replacement(item, memo) if isinstance(item, tf.keras.layers.Layer) else item
                if new is not item:
                    value[key] = new
