"""Which batch norm layers keep moving statistics per rank, so that hvdtrain averages them."""
from __future__ import annotations

import sys

from hvdtrain.kerases import is_floating
from hvdtrain.model.sync_bn import SyncBatchNormalizationBase


def keras_batch_norms() -> tuple:
    """Keras' batch norm layer classes, of each Keras this process has imported (Keras 2, Keras 3).
    Under Horovod (no tf.distribute strategy) each one, Keras' own synchronized variants
    included, updates its moving statistics from its own rank's batches."""
    found = []
    for name in ("tf_keras", "keras"):
        layers = getattr(sys.modules.get(name), "layers", None)
        if layers is not None:
            experimental = getattr(getattr(layers, "experimental", None), "SyncBatchNormalization", None)
            found += [layers.BatchNormalization] + ([experimental] if experimental is not None else [])
    return tuple(found)


def sublayers(layer) -> list:
    """The layers ``layer`` holds, nested ones included (Keras 2 and Keras 3 alike), each once."""
    return list(layer._flatten_layers(include_self=False, recursive=True))  # pylint: disable=protected-access


def _per_rank(layer) -> bool:
    """Whether ``layer`` is a batch norm layer that updates its moving statistics per rank."""
    return (isinstance(layer, keras_batch_norms())
            or isinstance(layer, SyncBatchNormalizationBase) and not layer.synchronized)


def per_rank_moving_statistics(model) -> list:
    """The moving statistics of the built per-rank batch norm layers in ``model``, nested ones
    included: their floating-point non-trainable variables (moving mean and variance, and with
    Keras' ``renorm=True`` its moving standard deviation and renormalization statistics).

    Such a layer (Keras' own, in a user's model, or :class:`hvdtrain.SyncBatchNormalization` with
    ``synchronized=False``, as ``--no-sync-bn`` builds) updates them from its own rank's batches,
    so they drift apart across ranks; a synchronized one keeps them identical. A layer that was
    never called has none yet.
    """
    return [v for layer in sublayers(model) if _per_rank(layer) and layer.built
            for v in layer.non_trainable_weights if is_floating(v)]
