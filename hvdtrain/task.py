"""A run's task: its loss and metrics (:class:`~hvdtrain.metrics.Objective`) for the labels the data
holds, and the outputs that the model must give for them."""
from __future__ import annotations

from typing import Callable, Sequence, Union

from hvdtrain.config import CLASSES
from hvdtrain.errors import HvdtrainError
from hvdtrain.imports import name_of
from hvdtrain.losses import Loss
from hvdtrain.metrics import Objective, get_metric


def build_objective(loss: Loss, metrics: Sequence, dataset) -> Objective:
    """The run's :class:`Objective`: ``loss`` and ``metrics`` (names, :class:`~hvdtrain.metrics.Metric`
    objects or callables: :func:`~hvdtrain.metrics.get_metric`), for the labels of ``dataset``.

    Raises:
        HvdtrainError: if the loss takes other labels than the dataset holds (targets from a
            streamed dataset of class indices), or for a metric that does not fit them.
    """
    if loss.labels is not None and loss.labels != dataset.labels:
        raise HvdtrainError(f"--loss {loss.name} takes {loss.labels} as labels, but {dataset.name} holds {dataset.labels}"
                            f" (class indices: --loss sparse_categorical_crossentropy)")
    return Objective(loss, [get_metric(metric, loss, dataset.labels, dataset.num_classes) for metric in metrics])


def expected_outputs(loss: Loss, dataset) -> dict:
    """:func:`~hvdtrain.model.zoo.build_model`'s ``output_shape`` and ``outputs`` for ``loss`` and the labels of ``dataset``:
    logits of ``K`` classes per label, or outputs shaped like the targets."""
    label_shape = tuple(dataset.label_shape)
    if dataset.labels == CLASSES:
        where = f" for labels of shape {label_shape} per image" if label_shape else ""
        return {"output_shape": (*label_shape, dataset.num_classes),
                "outputs": f"logits of the {dataset.num_classes} classes{where} (--loss {loss.name})"}
    return {"output_shape": label_shape, "outputs": f"outputs shaped like the targets (--loss {loss.name})"}


def check_objective(objective: Objective, model, dataset) -> None:
    """Run ``objective`` once on ``model``'s outputs for two blank images and labels of the data's
    shape (:meth:`Objective.check`): a loss or metric that fails is named before training.

    Raises:
        HvdtrainError: naming the loss or metric.
    """
    import tensorflow as tf

    images = tf.zeros((2, *dataset.input_shape))
    labels = tf.zeros((2, *dataset.label_shape), tf.int32 if dataset.labels == CLASSES else tf.float32)
    objective.check(labels, model(images, training=False))


def model_label(model: Union[str, Callable]) -> str:
    """A model's name, or its function's, for the banner and checkpoints."""
    return name_of(model)
