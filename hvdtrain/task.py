"""A run's task: its loss and metrics as one :class:`Objective` for the labels the data holds, and
the outputs that the model must give for them."""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf

from hvdtrain.config import CLASSES
from hvdtrain.errors import EveryRankError, HvdtrainError
from hvdtrain.user_code import name_of
from hvdtrain.losses import Loss, at_loss_dtype
from hvdtrain.metrics import Metric, get_metric


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


class Objective:
    """A run's loss and metrics, over one float64 sums vector ``[loss sum, examples, *metric sums]``.

    Args:
        loss: the :class:`~hvdtrain.losses.Loss`.
        metrics: the :class:`Metric` objects (names must differ, and not be ``loss``).

    Call arguments:
        labels: ``(b, ...)`` int32 class indices or float32 targets.
        outputs: the model's outputs, any float dtype.

    Returns (of a call):
        ``(per_example, sums)``: float32 ``(b,)`` losses and float64 ``(size,)`` sums.

    Raises:
        HvdtrainError: for two metrics of one name.
    """

    def __init__(self, loss: Loss, metrics: Sequence[Metric] = ()):
        self.loss, self.metrics = loss, list(metrics)
        names = ["loss", "count"] + [m.name for m in self.metrics]
        if len(set(names)) != len(names):
            raise HvdtrainError(f"metric names must differ from each other and from 'loss', got {names[2:]}")
        self.size = 2 + sum(m.size for m in self.metrics)

    @property
    def names(self) -> List[str]:
        """``["loss", *metric names]``: the keys of :meth:`results` besides ``count``."""
        return ["loss"] + [m.name for m in self.metrics]

    def __call__(self, labels: tf.Tensor, outputs: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
        outputs = at_loss_dtype(outputs)
        losses = self.loss(labels, outputs)
        sums = [tf.stack([tf.reduce_sum(tf.cast(losses, tf.float64)), tf.cast(tf.shape(losses)[0], tf.float64)])]
        sums += [m.sums(labels, outputs) for m in self.metrics]
        return losses, tf.concat(sums, 0)

    def check(self, labels: tf.Tensor, outputs: tf.Tensor) -> None:
        """Run the loss and metrics once, eagerly, on a batch of ``labels`` and model ``outputs``
        (before training: a user's function that fails, or gives one value per batch, is named
        here, not in the middle of a compiled step).

        Raises:
            HvdtrainError: naming the loss or metric that fails or gives other than one value per example.
        """
        batch = int(labels.shape[0])
        for name, run in [(f"the loss {self.loss.name}", lambda: self.loss(labels, at_loss_dtype(outputs)))] + [
                (f"the metric {m.name}", lambda m=m: m.sums(labels, at_loss_dtype(outputs))) for m in self.metrics]:
            try:
                value = run()
            except HvdtrainError:
                raise
            except Exception as e:  # noqa: BLE001 -- the user's code: report it as theirs
                first = (str(e).strip().splitlines() or [""])[0]
                raise HvdtrainError(f"{name} fails on labels {tuple(labels.shape)} {labels.dtype.name} and outputs "
                                    f"{tuple(outputs.shape)}: {type(e).__name__}: {first}") from e
            if name.startswith("the loss") and tuple(value.shape) != (batch,):
                raise HvdtrainError(f"{name} gives shape {tuple(value.shape)} for a batch of {batch}: one loss per "
                                    f"example is needed")

    def results(self, sums: Sequence[float]) -> Dict[str, float]:
        """``{"loss", *metric names, "count"}`` from global sums (``count``: examples, an int)."""
        sums = np.asarray(sums, np.float64)
        out = {"loss": float(sums[0] / max(sums[1], 1.0))}
        offset = 2
        for metric in self.metrics:
            out[metric.name] = metric.result(sums[offset:offset + metric.size])
            offset += metric.size
        out["count"] = int(sums[1])
        return out

    @staticmethod
    def examples(sums: Sequence[float]) -> float:
        """The examples counted in ``sums``."""
        return float(np.asarray(sums)[1])

    @property
    def layout(self) -> Tuple[str, ...]:
        """What the sums are: the loss's name, then ``"<metric>:<size>"`` of each metric."""
        return (self.loss.name, *(f"{m.name}:{m.size}" for m in self.metrics))

    def start_sums(self, position=None) -> np.ndarray:
        """float64 ``(size,)``: an epoch's sums so far, the ``epoch_sums`` of a resumed mid-epoch
        :class:`~hvdtrain.position.TrainPosition`, or zeros (None, or a position without sums).

        Raises:
            EveryRankError: for sums of another loss or other metrics (a checkpoint of a run with
                other ``--loss`` or ``--metrics``).
        """
        sums = position.epoch_sums if position is not None else None
        if not sums:
            return np.zeros(self.size)
        layout = position.sums_layout
        if len(sums) != self.size or (layout is not None and tuple(layout) != self.layout):
            raise EveryRankError(f"the checkpoint, mid-epoch, holds the sums of another loss or other metrics "
                                 f"({', '.join(layout) if layout else f'{len(sums)} numbers'}, where this run has "
                                 f"{', '.join(self.layout)}): resume with the --loss and --metrics of the run that "
                                 f"wrote it")
        return np.asarray(sums, np.float64)


def prefixed(split: str, results: Dict[str, float]) -> Dict[str, float]:
    """``{"<split>_loss": ..., "<split>_<metric>": ...}`` of :meth:`Objective.results` (without ``count``)."""
    return {f"{split}_{name}": value for name, value in results.items() if name != "count"}
