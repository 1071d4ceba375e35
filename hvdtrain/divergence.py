"""Divergence checks that stop every rank at the same step: from allreduced values only, so
that every rank finds a NaN or an infinity alike, and never after a diverged state is saved."""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from hvdtrain import kerases
from hvdtrain.errors import EveryRankError


def diverged(what: str) -> EveryRankError:
    """The error that stops every rank at the same point, where ``what`` was found NaN or infinite
    (from allreduced values, so every rank finds it alike)."""
    return EveryRankError(
        f"training diverged: {what}; every rank stopped there. No diverged state was checkpointed: --resume "
        f"from the last checkpoint with a smaller --lr or longer --warmup-epochs")


def non_finite_counter(model):
    """A compiled function of no arguments: the number (int64 scalar) of NaN and infinite values
    in ``model``'s floating-point variables (weights and moving statistics)."""
    variables = [v for v in model.variables if kerases.is_floating(v)]

    @tf.function(input_signature=[])
    def count_non_finite():
        counts = [tf.reduce_sum(tf.cast(tf.logical_not(tf.math.is_finite(v)), tf.int64)) for v in variables]
        return tf.add_n(counts) if counts else tf.constant(0, tf.int64)

    return count_non_finite


def checked(metrics: dict, epoch: int, step: int) -> dict:
    """``metrics`` (global training metrics, allreduced), if the loss is finite.

    Every rank sees the same values at the same step and raises together. Each step's loss is
    computed before its update: :func:`saveable` checks the update before a save.

    Raises:
        EveryRankError: when the loss is NaN or infinite (a model's own step that reports no
            ``loss``, a GAN's two: when any value it reports is).
    """
    watched = {"loss": metrics["loss"]} if "loss" in metrics else {k: v for k, v in metrics.items() if k != "count"}
    for name, value in watched.items():
        if not np.isfinite(value):
            raise diverged(f"the global training {name} is {value} at epoch {epoch + 1}, step {step + 1}")
    return metrics


def saveable(objective, sums, non_finite: int, epoch: int, step: int) -> dict:
    """The training metrics of ``sums`` (``objective.results``), before a save after ``step``
    (0-based) of ``epoch``, if neither the global training loss nor any variable is NaN or
    infinite (``non_finite``: the global count of such values, beyond those the model started with).

    Raises:
        EveryRankError: when either is not.
    """
    metrics = checked(objective.results(sums), epoch, step)
    if non_finite:
        raise diverged(f"{non_finite:,} value(s) of the model's variables are NaN or infinite at the "
                       f"check after epoch {epoch + 1}, step {step + 1}")
    return metrics
