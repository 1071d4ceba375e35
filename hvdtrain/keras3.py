"""hvdtrain's Keras layers and schedule for Keras 3 models (``import keras``, TensorFlow backend).

The same algorithms as their Keras 2 counterparts (:mod:`hvdtrain.keras2`), as Keras 3 classes
(``hvdtrain.SyncBatchNormalization`` is this one where Keras 3 is installed), registered with Keras 3's serialization (``keras.saving``) as
``hvdtrain>SyncBatchNormalization``, ``hvdtrain>SeededDropout`` and ``hvdtrain>WarmupSchedule``::

    import keras
    import hvdtrain

    x = keras.layers.Conv2D(32, 3, use_bias=False)(inputs)
    x = hvdtrain.keras3.SyncBatchNormalization(activation="relu")(x)

Importing this module imports Keras 3; it raises :class:`~hvdtrain.errors.HvdtrainError` where
Keras 3 is not installed (TensorFlow <= 2.15) or runs on another backend
(:func:`hvdtrain.kerases.keras3`).
"""
from hvdtrain.kerases import keras3 as _keras3
from hvdtrain.model.sync_bn import layer_class as _layer_class
from hvdtrain.model.zoo import dropout_class as _dropout_class
from hvdtrain.optim import schedule_class as _schedule_class

_keras = _keras3()
SyncBatchNormalization = _layer_class(_keras)
SeededDropout = _dropout_class(_keras)
WarmupSchedule = _schedule_class(_keras)

__all__ = ["SyncBatchNormalization", "SeededDropout", "WarmupSchedule"]
