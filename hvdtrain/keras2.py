"""hvdtrain's Keras layers and schedule for Keras 2 models (``tf.keras`` where it is Keras 2:
TensorFlow <= 2.15, or ``TF_USE_LEGACY_KERAS=1`` as ``import hvdtrain`` sets it; the ``tf_keras``
package), registered with Keras 2's serialization as ``hvdtrain>SyncBatchNormalization``,
``hvdtrain>SeededDropout`` and ``hvdtrain>WarmupSchedule``::

    import tensorflow as tf
    import hvdtrain.keras2

    x = tf.keras.layers.Conv2D(32, 3, use_bias=False)(inputs)
    x = hvdtrain.keras2.SyncBatchNormalization(activation="relu")(x)

The same algorithms as :mod:`hvdtrain.keras3`'s, as Keras 2 classes; ``hvdtrain.SyncBatchNormalization``
is the class of TensorFlow's default Keras (3 where installed). Importing this module imports
Keras 2; it raises :class:`~hvdtrain.errors.HvdtrainError` where Keras 2 is not installed
(:func:`hvdtrain.kerases.keras2`).
"""
from hvdtrain.kerases import keras2 as _keras2
from hvdtrain.model.sync_bn import layer_class as _layer_class
from hvdtrain.model.zoo import dropout_class as _dropout_class
from hvdtrain.optim import schedule_class as _schedule_class

_keras = _keras2()
SyncBatchNormalization = _layer_class(_keras)
SeededDropout = _dropout_class(_keras)
WarmupSchedule = _schedule_class(_keras)

__all__ = ["SyncBatchNormalization", "SeededDropout", "WarmupSchedule"]
