"""Training losses, as one loss per example: float32, or float64 for a float64 model (``--precision fp64``).

A rank's step sums its examples' losses and scales the sum by ``world_size / global_count``
(:mod:`hvdtrain.step`), so that Horovod's average of the ranks' gradients is the gradient of the
mean loss over the global batch. That needs a loss per example, never a batch mean: a mean over
a short last local batch would weight its examples more than the others'.

Dense outputs (segmentation: logits ``(b, H, W, K)``, labels ``(b, H, W)``) give a loss per
element; the loss of an example is their mean over its non-batch axes.
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import tensorflow as tf

from hvdtrain import kerases
from hvdtrain.config import CLASSES, LOSSES, TARGETS
from hvdtrain.errors import HvdtrainError
from hvdtrain.user_code import name_of


def loss_dtype(dtype: tf.DType) -> tf.DType:
    """The dtype losses and metrics are computed in for outputs of ``dtype``: float64 for float64
    (a float64 reference keeps its precision to the last step), float32 for any other (half
    precision's narrow range is for the layers, not the loss)."""
    return tf.float64 if tf.as_dtype(dtype) == tf.float64 else tf.float32


def at_loss_dtype(values: tf.Tensor) -> tf.Tensor:
    """``values`` cast to :func:`loss_dtype` of theirs."""
    return tf.cast(values, loss_dtype(values.dtype))


def per_example(values: tf.Tensor, what: str = "the loss") -> tf.Tensor:
    """``(b, ...)`` per-element values -> ``(b,)`` (float32, or float64 for float64 values): the
    mean over each example's elements.

    Raises:
        HvdtrainError: for one value of the whole batch (a batch mean), which summed over ranks
            would weight a short batch like a full one; naming ``what`` gave it.
    """
    values = at_loss_dtype(values)
    if values.shape.rank == 0:
        raise HvdtrainError(f"{what} returned one value for the whole batch (a mean): it must give one per example "
                            f"(shape (b,) or (b, ...)), which hvdtrain sums over every rank's examples")
    if values.shape.rank is not None and values.shape.rank <= 1:
        return values
    return tf.reduce_mean(tf.reshape(values, [tf.shape(values)[0], -1]), axis=1)


class Loss:
    """A loss hvdtrain trains with: labels and outputs of a local batch -> one loss per example.

    Args:
        name: for logs and checkpoints.
        fn: ``fn(labels, outputs)`` -> per-element losses ``(b, ...)`` (reduced by :func:`per_example`).
        labels: :data:`CLASSES` (integer class indices, ``outputs`` has one more axis of ``K``
            logits), :data:`TARGETS` (values of ``outputs``' shape), or None: whichever the data
            holds (integer labels are classes, floating-point ones targets).

    Call arguments:
        labels: ``(b, ...)`` int32 class indices or float32 targets.
        outputs: the model's ``(b, ..., K)`` logits or values, any float dtype (taken to float32;
            float64 stays float64).

    Output shape:
        ``(b,)``, float32 (float64 for float64 outputs).
    """

    def __init__(self, name: str, fn: Callable, labels: Optional[str] = CLASSES):
        if labels not in (CLASSES, TARGETS, None):
            raise ValueError(f"labels must be {CLASSES!r}, {TARGETS!r} or None, got {labels!r}")
        self.name, self.fn, self.labels = name, fn, labels

    def __call__(self, labels: tf.Tensor, outputs: tf.Tensor) -> tf.Tensor:
        outputs = at_loss_dtype(outputs)
        if self.labels == TARGETS:
            labels = tf.cast(labels, outputs.dtype)
        return per_example(self.fn(labels, outputs), f"the loss {self.name}")

    def __repr__(self) -> str:
        return f"Loss({self.name!r})"


def sparse_categorical_crossentropy(label_smoothing: float = 0.0) -> Loss:
    """Softmax cross-entropy of logits ``(b, ..., K)`` against class indices ``(b, ...)``.

    With ``label_smoothing`` ε the target is ``(1 - ε)·one_hot + ε/K`` (Szegedy et al. 2016,
    "Rethinking the Inception Architecture", section 7), as Keras' categorical cross-entropy.
    """
    def fn(labels, logits):
        if not label_smoothing:
            return tf.keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
        one_hot = tf.one_hot(labels, tf.shape(logits)[-1], dtype=logits.dtype)
        return tf.keras.losses.categorical_crossentropy(one_hot, logits, from_logits=True,
                                                        label_smoothing=label_smoothing)

    return Loss("sparse_categorical_crossentropy", fn, CLASSES)


def binary_crossentropy(label_smoothing: float = 0.0) -> Loss:
    """Sigmoid cross-entropy of logits ``(b, ..., K)`` against targets in [0, 1] of the same shape
    (multi-label: ``K`` independent yes/no labels), with labels smoothed towards 1/2 by ``label_smoothing``."""
    def fn(targets, logits):
        if label_smoothing:
            targets = targets * (1.0 - label_smoothing) + 0.5 * label_smoothing
        return tf.nn.sigmoid_cross_entropy_with_logits(labels=targets, logits=logits)

    return Loss("binary_crossentropy", fn, TARGETS)


def mse() -> Loss:
    """Mean squared error of outputs against targets of the same shape."""
    return Loss("mse", lambda targets, outputs: tf.math.squared_difference(outputs, targets), TARGETS)


def get_loss(spec: Union[str, Loss, Callable], label_smoothing: float = 0.0) -> Loss:
    """The :class:`Loss` for ``--loss`` or the Python API's ``loss=``.

    Args:
        spec: a name in :data:`LOSSES`; a :class:`Loss`; a Keras (2 or 3) ``losses.Loss`` object (its
            unreduced ``call`` is used, so its own ``reduction`` does not apply); or a callable
            ``fn(labels, outputs)`` returning per-example or per-element losses ``(b, ...)``
            (labels passed as they are stored: int32 classes or float32 targets).
        label_smoothing: in [0, 1), for the two cross-entropies.

    Raises:
        HvdtrainError: for an unknown name, or label smoothing with a loss that has none.
    """
    if isinstance(spec, Loss):
        return spec
    if label_smoothing and spec not in ("sparse_categorical_crossentropy", "binary_crossentropy"):
        raise HvdtrainError(f"--label-smoothing applies to sparse_categorical_crossentropy and binary_crossentropy, "
                            f"not {name_of(spec)}")
    if spec == "sparse_categorical_crossentropy":
        return sparse_categorical_crossentropy(label_smoothing)
    if spec == "binary_crossentropy":
        return binary_crossentropy(label_smoothing)
    if spec == "mse":
        return mse()
    if isinstance(spec, str):
        raise HvdtrainError(f"--loss {spec!r}: unknown loss; choose one of {LOSSES} (or pass a callable to hvdtrain.fit)")
    if _is_keras_loss(spec):
        if getattr(spec, "_fn_kwargs", {}).get("from_logits") is False:
            raise HvdtrainError(f"the loss {type(spec).__name__} takes probabilities (from_logits=False), but the "
                                f"models give logits: pass from_logits=True")
        return Loss(spec.name, spec.call, _labels_of(spec))
    if callable(spec):
        return Loss(name_of(spec), spec, None)
    raise HvdtrainError(f"loss must be one of {LOSSES}, a Keras loss or a callable, got {type(spec).__name__}")


def _is_keras_loss(spec) -> bool:
    """A ``Loss`` object of Keras 2 or Keras 3."""
    version = kerases.version_of(spec)
    return version is not None and isinstance(spec, kerases.module(version).losses.Loss)


def _labels_of(loss) -> str:
    """Keras' sparse losses take class indices; its other losses take targets shaped like the outputs."""
    return CLASSES if type(loss).__name__.startswith("Sparse") else TARGETS
