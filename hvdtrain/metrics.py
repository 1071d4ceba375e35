"""The training loss and exact global metrics: each rank sums, one allreduce adds, then divide.

Averaging the ranks' means would weight a rank's short last batch like a full one; sums of
float64 ``[loss, correct, count]`` allreduced over ranks are exact over every example.
"""
from __future__ import annotations

from typing import Sequence

import tensorflow as tf


def loss_and_sums(logits: tf.Tensor, labels: tf.Tensor):
    """Per-example sparse cross-entropy and this batch's sums.

    Args:
        logits: ``(b, K)`` of any float dtype (bfloat16/float16 under a mixed-precision policy;
            taken to float32).
        labels: ``(b,)`` int32 class indices.

    Returns:
        ``(per_example, sums)``: float32 ``(b,)`` losses, and float64 ``(3,)``
        ``[loss sum, correct top-1 predictions, count]``.
    """
    logits = tf.cast(logits, tf.float32)
    per_example = tf.keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
    correct = tf.equal(tf.argmax(logits, 1, output_type=tf.int32), labels)
    sums = tf.stack([tf.reduce_sum(tf.cast(per_example, tf.float64)), tf.reduce_sum(tf.cast(correct, tf.float64)),
                     tf.cast(tf.size(labels), tf.float64)])
    return per_example, sums


def mean_metrics(sums: Sequence[float]) -> dict:
    """``{"loss", "accuracy", "count"}`` from global ``[loss sum, correct, count]`` sums."""
    loss_sum, correct, count = sums
    return {"loss": loss_sum / max(count, 1.0), "accuracy": correct / max(count, 1.0), "count": int(count)}
