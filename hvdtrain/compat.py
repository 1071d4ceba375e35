"""Which Keras hvdtrain trains with, and a clear refusal of the one it cannot.

hvdtrain averages gradients with Horovod's ``DistributedOptimizer`` over ``tf.keras`` Keras 2
(TensorFlow <= 2.15's own, or the ``tf_keras`` package that ``TF_USE_LEGACY_KERAS=1`` selects on
TensorFlow >= 2.16, set by :mod:`hvdtrain`'s import). A Keras 3 model or optimizer (``import
keras`` on TensorFlow >= 2.16) is not one Horovod's wrapper handles: its gradients could go
unaveraged, each rank training its own model (horovod/horovod#4040), so it is refused.
"""
from __future__ import annotations

import importlib.util
import os

from hvdtrain.errors import HvdtrainError

_KERAS2_HINT = ("hvdtrain trains tf.keras models (Keras 2): build it with tf.keras (with TF_USE_LEGACY_KERAS=1 and "
                "the tf-keras package matching TensorFlow, as scripts/setup.sh installs), not `import keras` (Keras 3), "
                "whose gradients Horovod's DistributedOptimizer would not average")


def _is_keras3(obj) -> bool:
    """True for an object (or class) of Keras 3's ``keras`` package (not tf_keras, not TensorFlow's
    own Keras 2)."""
    module = obj.__module__ if isinstance(obj, type) else type(obj).__module__
    if not (module == "keras" or module.startswith("keras.")):
        return False
    import keras

    return int(keras.__version__.split(".")[0]) >= 3


def require_keras2(model=None, optimizer=None) -> None:
    """Refuse a Keras 3 ``model`` or ``optimizer``, and a ``tf.keras`` that is Keras 3.

    Raises:
        HvdtrainError: naming what is Keras 3 and how to get Keras 2.
    """
    import tensorflow as tf

    if _is_keras3(tf.keras.layers.Layer):
        if importlib.util.find_spec("tf_keras") is None:
            fix = f"install tf-keras=={tf.__version__} (scripts/setup.sh does) and import hvdtrain first"
        elif os.environ.get("TF_USE_LEGACY_KERAS", "1").lower() in ("0", "false", "no", ""):
            fix = f"TF_USE_LEGACY_KERAS={os.environ['TF_USE_LEGACY_KERAS']} selects Keras 3: set TF_USE_LEGACY_KERAS=1"
        else:  # tf.keras chose its Keras at its first use, before `import hvdtrain` set TF_USE_LEGACY_KERAS
            fix = ("tf.keras was first used before `import hvdtrain`, which selects Keras 2 (tf_keras): import "
                   "hvdtrain before using tf.keras, or export TF_USE_LEGACY_KERAS=1")
        raise HvdtrainError(f"tf.keras is Keras 3 here (TensorFlow {tf.__version__}): {fix}; " + _KERAS2_HINT)
    for what, obj in (("model", model), ("optimizer", optimizer)):
        if obj is not None and _is_keras3(obj):
            raise HvdtrainError(f"the {what} ({type(obj).__module__}.{type(obj).__name__}) is a Keras 3 object; "
                                + _KERAS2_HINT)
