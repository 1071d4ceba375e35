"""Which batch norm layers keep moving statistics per rank, so that hvdtrain averages them."""
from __future__ import annotations

from typing import List

import tensorflow as tf

from hvdtrain.model.sync_bn import SyncBatchNormalization


def keras_batch_norms() -> tuple:
    """Keras' batch norm layer classes. Under Horovod (no tf.distribute strategy) each one, Keras'
    own synchronized variants included, updates its moving statistics from its own rank's batches.
    (Looked up when called: a module-level lookup would fail at import where tf.keras is Keras 3,
    before hvdtrain could say so.)"""
    layers = tf.keras.layers
    experimental = getattr(getattr(layers, "experimental", None), "SyncBatchNormalization", None)
    return (layers.BatchNormalization,) + ((experimental,) if experimental is not None else ())


def _per_rank(layer: tf.Module) -> bool:
    """Whether ``layer`` is a batch norm layer that updates its moving statistics per rank."""
    return (isinstance(layer, keras_batch_norms())
            or isinstance(layer, SyncBatchNormalization) and not layer.synchronized)


def per_rank_moving_statistics(model: tf.keras.Model) -> List[tf.Variable]:
    """The moving statistics of the built per-rank batch norm layers in ``model``, nested ones
    included: their floating-point non-trainable variables (moving mean and variance, and with
    Keras' ``renorm=True`` its moving standard deviation and renormalization statistics).

    Such a layer (Keras' own, in a user's model, or :class:`hvdtrain.SyncBatchNormalization` with
    ``synchronized=False``, as ``--no-sync-bn`` builds) updates them from its own rank's batches,
    so they drift apart across ranks; a synchronized one keeps them identical. A layer that was
    never called has none yet.
    """
    return [v for layer in model.submodules if _per_rank(layer) and layer.built
            for v in layer.non_trainable_weights if v.dtype.is_floating]
