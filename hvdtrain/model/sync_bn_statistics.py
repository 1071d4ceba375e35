"""Statistics of :class:`~hvdtrain.model.sync_bn.SyncBatchNormalizationBase`: this rank's
per-channel sums on TensorFlow's ops (the CPU kernels compute the same in one pass), with a mask's
positions left out, and the update of the moving statistics.

A mask marks each position (an example's time step, say) that counts: Keras' BatchNormalization
leaves the others out of the batch statistics (Keras 2.12 and later), and so does the layer, over
every rank's batch. Every position is still normalized, and the gradient reaches every input
through the statistics only where the mask is set.
"""
from __future__ import annotations

from typing import Optional, Sequence

import tensorflow as tf


def mask_weights(mask, input_shape: tf.TensorShape, axes: Sequence[int], dtype: tf.DType, name: str) -> tf.Tensor:
    """``mask`` as 0/1 weights of ``dtype`` that broadcast against the input: Keras' convention,
    a mask of the input's shape without its channel axis (``(b, steps)`` for ``(b, steps, C)``).

    Raises:
        ValueError: for a layer of several channel axes, or a mask of another rank, naming both shapes.
    """
    if len(axes) != 1 or mask.shape.rank != input_shape.rank - 1:
        raise ValueError(f"{name}: a mask must have the input's shape without its one channel axis (Keras' "
                         f"convention); got a mask of shape {mask.shape} for input shape {input_shape} and "
                         f"axis {list(axes)}")
    return tf.expand_dims(tf.cast(mask, dtype), axes[0])


def channel_sums(t: tf.Tensor, reduction_axes: Sequence[int], channels: int) -> tf.Tensor:
    """Per-channel sums of ``t`` over ``reduction_axes``, as a flat ``[channels]`` vector."""
    return tf.reshape(tf.reduce_sum(t, reduction_axes), [channels])


def local_count(x: tf.Tensor, channels: int, weights: Optional[tf.Tensor] = None) -> tf.Tensor:
    """This rank's positions per channel in ``x`` (float64 scalar): all of them, or the mask's."""
    if weights is None:
        return tf.cast(tf.size(x, out_type=tf.int64) // channels, tf.float64)
    return tf.reduce_sum(tf.cast(weights, tf.float64))  # each position counts once, in every channel


def local_shifted_sums(x: tf.Tensor, shift: tf.Tensor, count: tf.Tensor, reduction_axes: Sequence[int],
                       broadcast_shape: Sequence[int], weights: Optional[tf.Tensor] = None):
    """This rank's per-channel ``Σ w·(x - shift)`` and ``Σ w·(x - shift)²`` (``w`` the mask's 0/1
    weights, or 1), float64 ``[C]`` each, ``C`` the product of ``broadcast_shape``.

    Two passes in ``x``'s dtype: a first mean ``m``, then sums of ``d = w·(x - m)`` and ``d²`` (the
    sum of ``d`` corrects the first mean's rounding; the squares carry no offset), re-expressed
    around ``shift`` (float64 ``[C]``) in float64 (Chan, Golub & LeVeque 1983).
    """
    channels = int(shift.shape[0])
    weighted = x if weights is None else x * weights
    first_mean = channel_sums(weighted, reduction_axes, channels) / tf.cast(tf.maximum(count, 1.0), x.dtype)
    dev = x - tf.reshape(first_mean, broadcast_shape)
    if weights is not None:
        dev = dev * weights
    dev_sum = tf.cast(channel_sums(dev, reduction_axes, channels), tf.float64)
    dev_sq_sum = tf.cast(channel_sums(tf.square(dev), reduction_axes, channels), tf.float64)
    offset = tf.cast(first_mean, tf.float64) - shift
    return dev_sum + count * offset, dev_sq_sum + 2.0 * offset * dev_sum + count * tf.square(offset)


def update_moving_statistics(layer, count: tf.Tensor, mean: tf.Tensor, variance: tf.Tensor) -> None:
    """``moving = momentum·moving + (1 - momentum)·batch`` for ``layer``'s moving mean and
    variance, in float64, from the global batch's ``count`` (float64 scalar), ``mean`` and biased
    ``variance`` (float64 ``[C]``); unchanged when the count is 0. With the layer's
    ``unbiased_moving_variance`` the variance tracked is ``variance·N/(N - 1)``, not updated for a
    single example."""
    has_data = count > 0
    has_variance = has_data
    if layer.unbiased_moving_variance:
        variance = variance * tf.math.divide_no_nan(count, count - 1.0)
        has_variance = count > 1
    m = layer.momentum
    for var, batch_value, update in ((layer.moving_mean, mean, has_data),
                                     (layer.moving_variance, variance, has_variance)):
        batch_value = tf.reshape(batch_value, tf.shape(var))
        updated = m * tf.cast(var, tf.float64) + (1.0 - m) * batch_value
        var.assign(tf.cast(tf.where(update, updated, tf.cast(var, tf.float64)), var.dtype))
