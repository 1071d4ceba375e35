"""Which batch norm layers keep moving statistics per rank, so that hvdtrain averages them."""
from __future__ import annotations

from typing import List

import tensorflow as tf

from hvdtrain.model.sync_bn import SyncBatchNormalization

# Keras' batch norm layers. Under Horovod (no tf.distribute strategy) each one, Keras' own
# synchronized variants included, updates its moving statistics from its own rank's batches.
_KERAS_BATCH_NORMS = (tf.keras.layers.BatchNormalization, tf.keras.layers.experimental.SyncBatchNormalization)


def _per_rank(layer: tf.Module) -> bool:
    """Whether ``layer`` is a batch norm layer that updates its moving statistics per rank."""
    return (isinstance(layer, _KERAS_BATCH_NORMS)
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
