"""Keras 3's ``BatchNormalization`` trained through TensorFlow's fused kernel: :func:`fuse_keras3_batch_norm`.

Keras 3's layer (TensorFlow backend) normalizes a training batch with composite ops (``moments``,
then ``tf.nn.batch_normalization``): in graph mode each is its own pass over the activations, and so
is each op of their gradient. Keras 2's layer calls ``FusedBatchNormV3`` (oneDNN's kernel on a CPU,
cuDNN's on a GPU), one pass forward and one back. Same layer, same model: Keras 3's step was 0.77x
Keras 2's through hvdtrain (``benchmarks/user_models.py``). hvdtrain gives each plain Keras 3
``BatchNormalization`` it trains the fused kernel for its training call, with Keras 3's meaning
kept: the output, the biased batch variance in the moving variance, the same moving-average update.
The layer stays the user's (class, config, weights, saving); only how its training call computes
changes, where the kernel applies (see :func:`fuse_keras3_batch_norm`); elsewhere Keras' own call runs.
"""
from __future__ import annotations

import tensorflow as tf

from hvdtrain import kerases
from hvdtrain.model.moving_statistics import sublayers

_MARK = "_hvdtrain_fused_call"


def _keras3_batch_norm_class():
    """Keras 3's ``BatchNormalization``, or None where ``keras`` is not Keras 3 (TensorFlow 2.15's
    Keras 2 has its own layer, which calls the fused kernel already, at the same module path)."""
    if not kerases.keras3_installed():
        return None
    from keras.src.layers.normalization.batch_normalization import BatchNormalization

    return BatchNormalization


def fuse_keras3_batch_norm(model) -> int:
    """Give every plain Keras 3 ``BatchNormalization`` of ``model`` (nested ones too; subclasses
    keep their own ``call``) a training call through ``FusedBatchNormV3``.

    The fused call runs where it means what Keras' does: ``training=True`` on a trainable layer,
    no mask, no renorm, not ``synchronized``, float32 inputs normalized over their last axis, and an
    epsilon the kernel accepts (>= 1.001e-5). An input of rank 4 goes in as NHWC; one of another
    rank as ``(examples, 1, 1, channels)``, every axis but the last reduced, as Keras reduces it.
    The kernel returns the batch variance with Bessel's correction; the moving variance takes the
    biased one, as Keras 3's does (0 for a batch of one). Everything else is Keras' own call.

    Args:
        model: a Keras model (Keras 2 models have no such layer and are left as they are).

    Returns:
        The number of layers given the fused call (each layer once, however often it is called).
    """
    batch_norm = _keras3_batch_norm_class()
    if batch_norm is None:
        return 0
    layers = [m for m in sublayers(model) if type(m) is batch_norm] + ([model] if type(model) is batch_norm else [])
    count = 0
    for layer in {id(layer): layer for layer in layers}.values():
        if getattr(layer, _MARK, False):
            continue
        keras_call = layer.call

        def call(inputs, training=None, mask=None, layer=layer, keras_call=keras_call):
            if not _fused_applies(layer, inputs, training, mask):
                return keras_call(inputs, training=training, mask=mask)
            return _fused_training_call(layer, inputs)

        # object.__setattr__: Keras' attribute tracking has nothing to track in a function.
        object.__setattr__(layer, "call", call)
        object.__setattr__(layer, _MARK, True)
        count += 1
    return count


def _fused_applies(layer, inputs, training, mask) -> bool:
    rank = inputs.shape.rank
    return (bool(training) and layer.trainable and mask is None and not layer.renorm and not layer.synchronized
            and inputs.dtype == tf.float32 and layer.compute_dtype == "float32" and rank is not None and rank >= 2
            and layer.axis in (-1, rank - 1) and inputs.shape[-1] is not None and layer.epsilon >= 1.001e-5)


def _fused_training_call(layer, inputs):
    channels = inputs.shape[-1]
    x = inputs if inputs.shape.rank == 4 else tf.reshape(inputs, [-1, 1, 1, channels])
    gamma = tf.cast(layer.gamma, tf.float32) if layer.scale else tf.ones([channels])
    beta = tf.cast(layer.beta, tf.float32) if layer.center else tf.zeros([channels])
    y, mean, unbiased, *_ = tf.raw_ops.FusedBatchNormV3(
        x=x, scale=gamma, offset=beta, mean=tf.zeros([0]), variance=tf.zeros([0]), epsilon=layer.epsilon,
        data_format="NHWC", is_training=True)
    count = tf.cast(tf.size(x, out_type=tf.int64) // channels, tf.float32)
    variance = tf.where(count > 1.0, unbiased * ((count - 1.0) / tf.maximum(count, 1.0)), 0.0)
    momentum = layer.momentum
    layer.moving_mean.assign(tf.cast(layer.moving_mean, tf.float32) * momentum + mean * (1.0 - momentum))
    layer.moving_variance.assign(tf.cast(layer.moving_variance, tf.float32) * momentum + variance * (1.0 - momentum))
    return y if inputs.shape.rank == 4 else tf.reshape(y, tf.shape(inputs))
