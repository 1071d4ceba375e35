"""Exact global metrics: each rank sums, one allreduce adds, then divide.

Averaging the ranks' means would weight a rank's short last batch like a full one. Every metric
here is a function of float64 sums over examples instead (counts of correct predictions, a
confusion matrix), which an allreduce adds exactly; the value is computed from the global sums.
:class:`hvdtrain.task.Objective` puts the loss's sums and every metric's into one vector, so a step
adds to one variable and an epoch's metrics cost one allreduce.
"""
from __future__ import annotations

from typing import Callable, Union

import numpy as np
import tensorflow as tf

from hvdtrain.config import CLASSES, METRICS
from hvdtrain.errors import HvdtrainError
from hvdtrain.user_code import name_of
from hvdtrain.losses import Loss, per_example


class Metric:
    """A metric that is a function of sums over examples.

    Subclasses give ``size`` (the number of sums), :meth:`sums` and :meth:`result`.

    Attributes:
        name: the key in logs and histories (``train_<name>``, ``test_<name>``).
        size: length of the float64 sums vector.
    """

    name: str
    size: int

    def sums(self, labels: tf.Tensor, outputs: tf.Tensor) -> tf.Tensor:
        """float64 ``(size,)`` sums over a batch of ``labels`` and float32 ``outputs``."""
        raise NotImplementedError

    def result(self, sums: np.ndarray) -> float:
        """The metric of global ``sums`` (float64 ``(size,)``)."""
        raise NotImplementedError


def _count(values: tf.Tensor) -> tf.Tensor:
    return tf.cast(tf.size(values), tf.float64)


class _Fraction(Metric):
    """A metric of sums ``[numerator, count]``: their quotient (0 for no examples)."""

    size = 2

    def result(self, sums):
        return float(sums[0] / max(sums[1], 1.0))


class Accuracy(_Fraction):
    """The fraction of correct top-1 predictions: of class indices ``(b, ...)`` by logits
    ``(b, ..., K)`` (per pixel for dense outputs), or, for multi-label targets (``multi_label``),
    of each of the ``K`` yes/no labels by the sign of its logit. Sums: ``[correct, count]``."""

    def __init__(self, multi_label: bool = False):
        self.name, self.multi_label = "accuracy", multi_label

    def sums(self, labels, outputs):
        if self.multi_label:
            correct = tf.equal(outputs > 0, tf.cast(labels, tf.float32) > 0.5)
        else:
            correct = tf.equal(tf.argmax(outputs, -1, output_type=tf.int32), tf.cast(labels, tf.int32))
        return tf.stack([tf.reduce_sum(tf.cast(correct, tf.float64)), _count(correct)])


class TopKAccuracy(_Fraction):
    """The fraction of class labels among the ``k`` largest logits (``top5`` for k = 5).
    Sums: ``[correct, count]``. Ties at the k-th logit count as correct (``tf.math.in_top_k``)."""

    def __init__(self, k: int = 5):
        self.name, self.k = f"top{k}", k

    def sums(self, labels, outputs):
        logits = tf.cast(tf.reshape(outputs, [-1, tf.shape(outputs)[-1]]), tf.float32)  # in_top_k's one dtype
        correct = tf.math.in_top_k(tf.reshape(tf.cast(labels, tf.int32), [-1]), logits, self.k)
        return tf.stack([tf.reduce_sum(tf.cast(correct, tf.float64)), _count(correct)])


class MeanIoU(Metric):
    """Mean intersection-over-union of the predicted classes (``argmax`` of logits ``(b, ..., K)``)
    with class labels ``(b, ...)``, over the classes present in labels or predictions.

    Sums: the ``K x K`` confusion matrix (rows: label, columns: prediction), flattened. The
    allreduce adds the ranks' matrices, so the global mean IoU is exactly that of one process
    over all examples, unlike a mean of the ranks' IoUs. IoU of class k is
    ``C[k, k] / (sum_j C[k, j] + sum_i C[i, k] - C[k, k])`` (Everingham et al. 2010, "The PASCAL
    Visual Object Classes Challenge", section 4.2).
    """

    def __init__(self, num_classes: int):
        self.name, self.num_classes, self.size = "mean_iou", num_classes, num_classes * num_classes

    def sums(self, labels, outputs):
        predictions = tf.reshape(tf.argmax(outputs, -1, output_type=tf.int32), [-1])
        matrix = tf.math.confusion_matrix(tf.reshape(tf.cast(labels, tf.int32), [-1]), predictions,
                                          self.num_classes, dtype=tf.float64)
        return tf.reshape(matrix, [-1])

    def confusion_matrix(self, sums: np.ndarray) -> np.ndarray:
        """float64 ``(K, K)`` counts: rows labels, columns predictions."""
        return np.asarray(sums, np.float64).reshape(self.num_classes, self.num_classes)

    def result(self, sums):
        matrix = self.confusion_matrix(sums)
        hits = np.diag(matrix)
        union = matrix.sum(0) + matrix.sum(1) - hits
        present = union > 0
        return float(np.mean(hits[present] / union[present])) if present.any() else 0.0


class MeanOf(_Fraction):
    """The mean over examples of a user's per-example (or per-element) values:
    ``fn(labels, outputs) -> (b, ...)``, reduced per example as losses are. Sums: ``[total, count]``."""

    def __init__(self, name: str, fn: Callable):
        self.name, self.fn = name, fn

    def sums(self, labels, outputs):
        values = tf.cast(per_example(self.fn(labels, outputs), f"the metric {self.name}"), tf.float64)
        return tf.stack([tf.reduce_sum(values), _count(values)])


def get_metric(spec: Union[str, Metric, Callable], loss: Loss, labels: str, num_classes: int) -> Metric:
    """The :class:`Metric` for a ``--metrics`` name or the Python API's ``metrics=`` entry.

    Args:
        spec: a name in :data:`METRICS`, a :class:`Metric`, or a callable ``fn(labels, outputs)``
            returning per-example values (its mean over examples is reported under its ``__name__``).
        loss: the run's loss (``accuracy`` of a multi-label loss is per label).
        labels: what the data's labels are, :data:`~hvdtrain.losses.CLASSES` or ``TARGETS``.
        num_classes: ``K``, the outputs' last axis.

    Raises:
        HvdtrainError: for an unknown name, or a metric of class indices with targets as labels.
    """
    if isinstance(spec, Metric):
        return spec
    if callable(spec) and not isinstance(spec, str):
        return MeanOf(name_of(spec), spec)
    if spec not in METRICS:
        raise HvdtrainError(f"--metrics {spec!r}: unknown metric; choose from {METRICS} (or pass a callable to hvdtrain.fit)")
    if spec == "accuracy" and labels != CLASSES and loss.name == "binary_crossentropy":
        return Accuracy(multi_label=True)
    if labels != CLASSES:
        raise HvdtrainError(f"--metrics {spec}: needs class-index labels, but the loss {loss.name} takes targets")
    if spec == "accuracy":
        return Accuracy()
    if spec == "top5":
        if num_classes <= 5:
            raise HvdtrainError(f"--metrics top5: the labels have {num_classes} classes, so every label is among the "
                                f"top 5 (use accuracy)")
        return TopKAccuracy(5)
    return MeanIoU(num_classes)
