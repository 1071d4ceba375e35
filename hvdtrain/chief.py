"""Rank 0's part of a run: its start-up lines and its side effects (the recipe's one rank-0 block)."""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from typing import List, Optional

from hvdtrain import callbacks as cbs
from hvdtrain.checkpoint import CheckpointManager
from hvdtrain.config import CLASSES, Config, OptimConfig
from hvdtrain.data.sharding import ShardPlan
from hvdtrain.model.zoo import BUILTIN_MODELS
from hvdtrain.outputs import Curves
from hvdtrain.runtime.dist import DistContext
from hvdtrain.position import TrainPosition


def optimizer_summary(optim: OptimConfig) -> str:
    """``sgd (momentum 0.9)``, ``adamw (weight decay 0.05, clip norm 1)``...: the banner's optimizer."""
    parts = [f"momentum {optim.momentum:g}" + (", Nesterov" if optim.nesterov else "")] if optim.name == "sgd" else []
    parts += [f"weight decay {optim.weight_decay:g}"] if optim.weight_decay else []
    parts += [f"clip norm {optim.clip_norm:g} (after the allreduce)"] if optim.clip_norm else []
    return optim.name + (f" ({', '.join(parts)})" if parts else "")


def labels_summary(dataset) -> str:
    """``10 classes``, ``11 classes per pixel (28x28 label maps)`` or ``targets of shape (5,)``."""
    if dataset.labels == CLASSES:
        shape = tuple(dataset.label_shape)
        return f"{dataset.num_classes} classes" + (f" per pixel ({'x'.join(map(str, shape))} label maps)"
                                                   if shape else "")
    return f"targets of shape {tuple(dataset.label_shape)}"


def chief_callbacks(config: Config, run_dir: str, manager: CheckpointManager, plan: ShardPlan, optimizer,
                    meta: dict, unit: str = "img/s") -> List[cbs.Callback]:
    """Rank 0's side effects: progress bar, epoch lines, metrics.jsonl, curves.png, TensorBoard, checkpoints.

    Args:
        meta: what every checkpoint records besides its position (:func:`hvdtrain.rundir.checkpoint_meta`).
        unit: the epoch line's throughput unit: ``img/s`` (images), ``ex/s`` (a model object's examples).
    """
    return ([cbs.ProgressBar()] if config.log.progress else []) + [
        cbs.EpochLine(config.epochs, unit),
        cbs.JsonlMetrics(run_dir),
        Curves(run_dir),
        cbs.TensorBoard(run_dir, plan.steps_per_epoch, restart_markers=not config.elastic.enabled),
        cbs.Checkpointer(manager, meta, optimizer.iterations, every_steps=config.checkpoint.every_steps),
    ]


def parameter_count(model) -> int:
    """The model's weights (Keras' ``count_params``), also of a model Keras holds unbuilt (a GAN
    without ``call``: its parts are built)."""
    try:
        return int(model.count_params())
    except ValueError:
        return int(sum(np.prod(v.shape) for v in model.weights))


def _precision_of(model, config: Config) -> str:
    """``--precision``, or ``fp64`` for a model whose trainable variables are all float64 (built
    so by the user's ``keras.config.set_floatx("float64")``, say)."""
    variables = model.trainable_variables
    if variables and all(tf.as_dtype(v.dtype) == tf.float64 for v in variables):
        return "fp64"
    return config.compute.precision


def banner(ctx: DistContext, config: Config, dataset, plan: ShardPlan, schedule, model,
           run_dir: str, ckpt_dir: str, start: TrainPosition, objective=None, model_name: Optional[str] = None,
           own_step=None) -> str:
    """Rank 0's start-up lines: world size and pinning, data, batch arithmetic, learning rate,
    model, loss and metrics, run directory and where training starts.

    Args:
        objective: the run's :class:`~hvdtrain.task.Objective` (default: the config's names).
        model_name: what the model is called (default: ``config.model.name``).
        own_step: a Keras model object's :class:`~hvdtrain.keras_recipe.OwnStep` (its data, step
            and metrics are said its own way).
    """
    last = plan.global_batch_size(plan.steps_per_epoch - 1)
    leftover = last - plan.global_batch
    passes = config.optim.backward_passes_per_step
    start_step = plan.start_step(start.step, start.example)
    epochs = (f"epochs {start.epoch + 1}..{config.epochs}" if start.epoch < config.epochs
              else f"no epoch left to train of {config.epochs} (evaluation only)")
    model_name = model_name or config.model.name
    norm = ("user model" if model_name not in BUILTIN_MODELS
            else ("synchronized" if config.model.sync_bn else "per-rank") + " BatchNorm")
    if own_step is None:
        loss, metrics = ((objective.loss.name, [m.name for m in objective.metrics]) if objective is not None
                         else (config.task.loss, config.task.metric_names))
    return "\n".join([
        f"hvdtrain: world size {ctx.size} ({ctx.local_size} local rank(s) x {ctx.cross_size} host(s)), "
        f"device {ctx.device}, {ctx.intra_op_threads} thread(s) per rank",
        f"data:  {dataset.summary()}" if own_step is not None else
        f"data:  {dataset.name}: {dataset.num_train:,} train / {dataset.num_test:,} test, "
        f"{'x'.join(map(str, dataset.input_shape))}, " + labels_summary(dataset)
        + (f"; streamed by tf.data, augment {config.data.augment}" if config.data.streaming else "; in memory"),
        f"batch: local {plan.local_batch} x {ctx.size} rank(s) = global {plan.global_batch}; "
        f"{plan.steps_per_epoch} steps per epoch (last global batch {last}"
        + (f": the {leftover} example(s) left over, fewer than the ranks, join it" if leftover > 0 else "") + ")"
        + (f"; {passes} passes per update: {plan.global_batch * passes} examples per update, "
           f"{plan.steps_per_epoch // passes} updates per epoch" if passes > 1 else ""),
        (f"lr:    base {schedule.base_lr:g} x {ctx.size} = peak {schedule.peak_lr:g}, linear warmup "
         f"{config.optim.warmup_epochs:g} epoch(s) ({schedule.warmup_steps} steps), then {config.optim.lr_schedule}; "
         f"{optimizer_summary(config.optim)}" if schedule is not None else
         "lr:    the optimizer's own learning rate or schedule (not scaled by world size)"),
        f"model: {model_name} ({norm}), {parameter_count(model):,} parameters, {_precision_of(model, config)}"
        + (" (dynamic loss scaling)" if config.compute.precision == "fp16" else "")
        + (", forward and backward pass compiled by XLA" if config.compute.xla else ""),
        *(own_step.banner_lines() if own_step is not None else [
            f"task:  loss {loss}" + (f" (label smoothing {config.task.label_smoothing:g})"
                                     if config.task.label_smoothing else "")
            + f"; metrics {', '.join(metrics) or 'none'} (exact: sums allreduced over ranks)"]),
        f"run:   {run_dir} (checkpoints {ckpt_dir}), {epochs}"
        + (f", resuming at step {start_step + 1} of epoch {start.epoch + 1}" if start_step else ""),
    ])
