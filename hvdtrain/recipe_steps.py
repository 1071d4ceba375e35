"""The recipe's steps, one function each, in Horovod's order (README, "What it does").

:func:`hvdtrain.recipe.run` calls them top to bottom; an elastic job (:mod:`hvdtrain.elastic`)
calls steps 5-9 again with the workers there are after every reset. (Its step 5 is its own:
``ElasticJob._resume`` restores, at the job's first start only, a position in examples, which any
world size can continue.)

1. init and pin -- :func:`init_and_pin`
2. shard -- :func:`open_data`
3. model -- :func:`build_rank_model`
4. optimizer (scaled learning rate, ``hvd.DistributedOptimizer``) -- :func:`build_rank_optimizer`
5. restore -- :func:`restore`
6. broadcast -- :func:`broadcast_state`
7. rank 0 only -- :func:`rank_callbacks`
8. train -- :func:`make_trainer`, then :meth:`~hvdtrain.trainer.Trainer.fit`
9. save -- :func:`save_result`
"""
from __future__ import annotations

import dataclasses
from typing import Callable, List, NamedTuple, Optional, Sequence, Union

import tensorflow as tf

from hvdtrain import callbacks as cbs
from hvdtrain import kerases
from hvdtrain.callbacks import split_text
from hvdtrain.chief import banner, chief_callbacks
from hvdtrain.config import Config
from hvdtrain.data.in_memory import Dataset, data_mismatch
from hvdtrain.data.loading import open_dataset
from hvdtrain.data.sharding import ShardPlan
from hvdtrain.errors import EveryRankError, HvdtrainError
from hvdtrain.console import say
from hvdtrain.kerases import set_random_seed
from hvdtrain.keras_callbacks import KerasCallbacks, is_keras_callback
from hvdtrain.keras_step import has_own_step, step_name
from hvdtrain.losses import get_loss
from hvdtrain.task import Objective
from hvdtrain.model import sync_bn_kernels
from hvdtrain.model.moving_statistics import sublayers
from hvdtrain.model.sync_bn import SyncBatchNormalizationBase
from hvdtrain.model.zoo import build_model
from hvdtrain.optim import build_optimizer, users_optimizer
from hvdtrain.outputs import run_folder_line, save_trained_model
from hvdtrain.precision import DynamicLossScale, set_precision
from hvdtrain.rundir import checkpoint_dir, checkpoint_meta, open_run_dir, restore_for_resume, write_run_config
from hvdtrain.runtime.dist import DistContext, init_distributed
from hvdtrain.runtime.watchdog import Watchdog
from hvdtrain.position import TrainPosition
from hvdtrain.task import build_objective, check_objective, expected_outputs, model_label
from hvdtrain.trainer import Trainer


@dataclasses.dataclass(frozen=True)
class Parts:
    """What a Python caller (:func:`hvdtrain.fit`) gives in place of the config's names.

    Attributes:
        model: a built-in model's name or a function ``(input_shape=, num_classes=)`` -> model
            (:func:`hvdtrain.model.zoo.build_model`); None: ``config.model.name``.
        dataset: an in-memory :class:`~hvdtrain.data.in_memory.Dataset`; None: ``config.data``.
        data_function: ``(function, what messages call it)``: a data function (or one made of
            ``tf.data`` datasets) for ``config.data`` of ``dataset: function``, used as it is.
        loss: a name, a Keras loss or a callable (:func:`hvdtrain.losses.get_loss`); None: ``config.task.loss``.
        metrics: names, :class:`~hvdtrain.metrics.Metric` objects or callables; None: ``config.task.metrics``.
        callbacks: more :class:`~hvdtrain.callbacks.Callback` objects (chief-only ones run on rank 0
            only) and Keras callbacks (:mod:`hvdtrain.keras_callbacks`).
        optimizer: a Keras optimizer of the caller's (of the model's Keras), its learning rate (or schedule) used as it
            is; None: ``config.optim``'s, on hvdtrain's warmup schedule scaled by world size.
        examples: for a Keras model object (``model``), its data in Keras' ``fit`` forms
            (:mod:`hvdtrain.data.examples`), or a function ``(rank=, world_size=)`` that makes them: the model then
            trains by its own step (:mod:`hvdtrain.keras_recipe`).
        loss_weights: Keras' ``compile(loss_weights=...)`` for an uncompiled model object."""

    model: Optional[Union[str, Callable]] = None
    dataset: Optional[Dataset] = None
    data_function: Optional[tuple] = None
    loss: Optional[Union[str, Callable]] = None
    metrics: Optional[Sequence] = None
    callbacks: Sequence[cbs.Callback] = ()
    optimizer: Optional[object] = None
    examples: Optional[object] = None
    loss_weights: Optional[object] = None


class RankData(NamedTuple):
    """Step 2's result: the dataset, its loss and metrics, its fingerprint and this rank's shard plan."""

    dataset: object  # an in-memory Dataset or a StreamingDataset
    objective: Objective
    fingerprint: dict
    plan: ShardPlan


class RunFiles(NamedTuple):
    """Step 5's result: the run and checkpoint directories, the checkpoint manager (rank 0's; None
    elsewhere), where training starts, and what every checkpoint records besides its position
    (:func:`hvdtrain.rundir.checkpoint_meta`)."""

    run_dir: str
    ckpt_dir: str
    manager: object
    start: TrainPosition
    meta: dict


def init_and_pin(config: Config, watchdog: Watchdog) -> DistContext:
    """Step 1: Horovod up, this process on its own GPU or its own CPU cores, the watchdog armed.

    From ``hvd.init`` on, a rank left waiting for a stalled or unreachable peer -- in a start-up
    collective or in training -- aborts after ``--stall-timeout`` instead of hanging.
    """
    # hvdtrain's CPU kernels are custom ops, which XLA cannot compile.
    sync_bn_kernels.set_enabled(config.runtime.sync_bn_kernels and not config.compute.xla)
    ctx = init_distributed(threads=config.runtime.threads, use_gpu=not config.runtime.cpu,
                           stall_timeout=config.runtime.stall_timeout, elastic=config.elastic.enabled,
                           watchdog=watchdog, horovod_nice=config.runtime.horovod_nice,
                           horovod_cycle_time_ms=config.runtime.horovod_cycle_time_ms,
                           deterministic=config.runtime.deterministic)
    watchdog.arm("start-up")
    return ctx


def open_data(ctx: DistContext, config: Config, parts: Parts, watchdog: Watchdog) -> RankData:
    """Step 2: every rank opens the dataset (in memory, or streamed by tf.data), its labels read as
    the loss takes them, and checks it against rank 0's; the plan gives each rank a disjoint shard
    per epoch and the same number of steps (:class:`~hvdtrain.data.sharding.ShardPlan`).

    Raises:
        EveryRankError: for a training set smaller than one global batch, or a
            ``--backward-passes-per-step`` that does not divide the steps per epoch.
        FoundHere / PeerFailure: for data, loss or metrics one rank cannot use.
    """
    watchdog.beat("loading data")
    set_random_seed(config.seed)  # the same everywhere; initial weights are broadcast from rank 0 anyway
    loss = get_loss(config.task.loss if parts.loss is None else parts.loss, config.task.label_smoothing)
    dataset = parts.dataset or open_dataset(ctx, config.data, config.seed, watchdog, loss.labels,
                                            parts.data_function)
    metrics = config.task.metric_names if parts.metrics is None else parts.metrics
    objective = ctx.guarded("choosing the metrics", lambda: build_objective(loss, metrics, dataset))
    # The shard plan assumes every rank holds the same examples (same steps per rank, disjoint
    # shards): a host with another copy of the data would hang or overlap.
    fingerprint = dataset.fingerprint()
    if not config.elastic.enabled:  # an elastic job checks after each state sync instead
        agree_on_data(ctx, fingerprint)
    plan = ShardPlan(dataset.num_train, config.batch_size, ctx.size, ctx.rank, seed=config.seed)
    if config.epochs > 0:
        check_accumulation_fits_epochs(plan, config.optim.backward_passes_per_step)
    if dataset.num_train < plan.global_batch:
        raise EveryRankError(f"{dataset.name}: {dataset.num_train} training examples are fewer than one global "
                             f"batch ({ctx.size} ranks x --batch-size {config.batch_size}); use a smaller --batch-size")
    return RankData(dataset, objective, fingerprint, plan)


def build_rank_model(ctx: DistContext, config: Config, parts: Parts, data: RankData):
    """Step 3: the model, on this rank's device, in the configured precision (float32 variables),
    with synchronized BatchNorm (built-in models, or ``--convert-sync-bn``).

    Returns:
        ``(model, keras)``: the Keras model and its Keras module, which the caller's optimizer,
        loss and callbacks must share (:func:`hvdtrain.kerases.choose`).
    """
    set_precision(config.compute.precision)
    dataset = data.dataset
    with tf.device(ctx.device):
        model = ctx.guarded("building the model", lambda: build_model(
            parts.model or config.model.name, dataset.input_shape, dataset.num_classes, sync_bn=config.model.sync_bn,
            seed=config.seed, rank=ctx.rank, convert_sync_bn=config.model.convert_sync_bn, world_size=ctx.size,
            keras=config.model.keras, **expected_outputs(data.objective.loss, dataset)))
    ctx.guarded("checking the model's step", lambda: refuse_own_step(model))
    ctx.guarded("checking the loss and metrics", lambda: check_objective(data.objective, model, dataset))
    keras = kerases.module(ctx.guarded("checking the Keras objects", lambda: kerases.choose(
        kerases.version_of(model), model=model, optimizer=parts.optimizer, loss=parts.loss,
        callbacks=[cb for cb in parts.callbacks if is_keras_callback(cb)])))
    if config.compute.xla:
        refuse_collectives_under_xla(model, ctx.size)
    return model, keras


def build_rank_optimizer(ctx: DistContext, config: Config, parts: Parts, model, keras, plan: ShardPlan):
    """Step 4: the learning rate scaled by world size with warmup (a caller's own optimizer keeps its
    own); Horovod's wrapper averages gradients by allreduce. Its slots are built now so that they
    can be broadcast (step 6).

    Returns:
        ``(optimizer, schedule, loss_scale)``: the wrapped optimizer, hvdtrain's
        :class:`~hvdtrain.optim.WarmupSchedule` (None for the caller's optimizer) and fp16's
        :class:`~hvdtrain.precision.DynamicLossScale` (None in other precisions).
    """
    with tf.device(ctx.device):
        if parts.optimizer is None:
            optimizer, schedule = build_optimizer(config.optim, ctx.size, plan.steps_per_epoch, config.epochs,
                                                  model.trainable_variables, keras)
        else:
            optimizer, schedule = ctx.guarded("wrapping the optimizer", lambda: users_optimizer(
                parts.optimizer, config.optim)), None
            optimizer.build(model.trainable_variables)
        # fp16's loss scale lives among the optimizer's variables: broadcast and checkpointed with them.
        loss_scale = DynamicLossScale(optimizer) if config.compute.precision == "fp16" else None
    return optimizer, schedule, loss_scale


def restore(ctx: DistContext, config: Config, run_dir: str, model, optimizer, data: RankData) -> RunFiles:
    """Step 5: rank 0 opens the run directory and its checkpoints (:func:`open_checkpoints`);
    every rank learns where training starts."""
    ckpt_dir = checkpoint_dir(config, run_dir)
    meta = checkpoint_meta(config, ctx.size, data.plan.steps_per_epoch, data.fingerprint)
    manager, start = ctx.guarded("opening the run directory", lambda: open_checkpoints(
        config, run_dir, ckpt_dir, model, optimizer, meta) if ctx.is_chief else (None, None))
    return RunFiles(run_dir, ckpt_dir, manager, ctx.broadcast_object(start, name="hvdtrain.start"), meta)


def open_checkpoints(config: Config, run_dir: str, ckpt_dir: str, model, optimizer, meta: dict):
    """Rank 0's part of step 5: the checkpoint manager and the :class:`TrainPosition` to start from,
    restoring the latest checkpoint if ``--resume`` (the start, if the checkpoint directory holds
    none yet); then the run's ``config.yaml``.

    The checkpoint's layout (world size, local batch, steps per epoch, seed, the data's
    fingerprint: ``meta``'s) must be this run's: a resumed run continues the same sequence of
    global batches, so these cannot change.

    Returns:
        ``(manager, start)``.

    Raises:
        HvdtrainError: for a missing or foreign checkpoint, or one inside an accumulated update.
    """
    resume = config.checkpoint.resume
    manager = open_run_dir(config, run_dir, ckpt_dir, model, optimizer, fresh=not resume, must_exist=resume)
    start = TrainPosition()
    if resume:
        layout = {k: meta[k] for k in ("world_size", "batch_size", "steps_per_epoch", "seed", "data")}
        start = restore_for_resume(config, manager, run_dir, layout, meta["data"]["train_examples"])
        passes = config.optim.backward_passes_per_step
        if start.step % passes:
            # Horovod's count of accumulated passes starts at 0 in this process: the resumed step
            # must begin an update (a checkpoint of a run with another --backward-passes-per-step).
            raise HvdtrainError(f"--resume: the checkpoint is at step {start.step} of epoch {start.epoch + 1}, "
                                f"inside an update of --backward-passes-per-step {passes}; resume with the "
                                f"--backward-passes-per-step of the run that wrote it")
    write_run_config(config, run_dir)  # only now: a refused --resume leaves the run's own file as it was
    return manager, start


def state_variables(model, optimizer) -> list:
    """What every rank must hold alike: the model's variables (weights and BatchNorm's moving
    statistics) and the optimizer's (its slots, iteration count and fp16's loss scale); ``optimizer``
    may be a list of them (a GAN's two)."""
    optimizers = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
    return list(model.variables) + [v for o in optimizers for v in o.variables]


def broadcast_state(ctx: DistContext, model, optimizer) -> None:
    """Step 6: overwrite every rank's :func:`state_variables` with rank 0's (a collective).

    Needed once the variables exist -- random initialisation differs per rank -- and after rank 0
    restores a checkpoint. The optimizer's slots must already be built (``optimizer.build``).
    (Horovod Elastic's state sync broadcasts the same list, :class:`hvdtrain.elastic.TrainingState`.)
    """
    ctx.broadcast_variables(state_variables(model, optimizer), name="the broadcast of the initial state")


def rank_callbacks(ctx: DistContext, config: Config, parts: Parts, data: RankData, model, optimizer, schedule,
                   files: RunFiles, own_step=None) -> List[cbs.Callback]:
    """Step 7: the rank-0 block (banner, progress, logs, checkpoints: :mod:`hvdtrain.chief`), then
    the caller's callbacks (chief-only ones on rank 0 only; Keras callbacks on every rank, first,
    so that a learning rate they set is checkpointed).

    Raises:
        FoundHere / PeerFailure: where rank 0 cannot open its logs, or a Keras callback cannot be set up.
    """
    if ctx.is_chief:
        say(banner(ctx, config, data.dataset, data.plan, schedule, model, files.run_dir, files.ckpt_dir, files.start,
                   data.objective, model_label(parts.model or config.model.name), own_step))
    callbacks = ctx.guarded("opening the run's logs", lambda: chief_callbacks(
        config, files.run_dir, files.manager, data.plan, optimizer, files.meta,
        unit="ex/s" if own_step else "img/s") if ctx.is_chief else [])
    callbacks += [cb for cb in parts.callbacks if not is_keras_callback(cb) and (ctx.is_chief or not cb.chief_only)]
    keras_callbacks = [cb for cb in parts.callbacks if is_keras_callback(cb)]
    try:
        if keras_callbacks:
            callbacks.insert(0, ctx.guarded("setting up the Keras callbacks", lambda: KerasCallbacks(
                keras_callbacks, model, optimizer, ctx.is_chief, config.epochs, data.plan.steps_per_epoch)))
    except BaseException:
        cbs.close_all(callbacks)  # rank 0's logs, opened above, close with what they hold
        raise
    return callbacks


def make_trainer(ctx: DistContext, config: Config, data: RankData, model, optimizer, loss_scale,
                 callbacks: List[cbs.Callback], watchdog: Watchdog, elastic: bool = False, own_step=None) -> Trainer:
    """Step 8: the :class:`~hvdtrain.trainer.Trainer` that runs the same steps on every rank, each
    on its shard of ``data.plan``.

    Args:
        elastic: an elastic job: the ranks agree on the outcome of rank 0's writes (a new rank 0
            after a reset must know), and a signal ends a worker at once (Horovod's driver resets the others).
        own_step: a Keras model object's :class:`~hvdtrain.keras_recipe.OwnStep`: its own step trains.
    """
    watchdog.beat("the first training step")
    return Trainer(ctx, model, optimizer, data.dataset, data.plan, log_every=config.log.log_every,
                   eval_batch_size=config.eval_batch_size, callbacks=callbacks, watchdog=watchdog,
                   backward_passes_per_step=config.optim.backward_passes_per_step,
                   agree_on_writes=elastic, loss_scale=loss_scale, xla=config.compute.xla, objective=data.objective,
                   pipeline_nice=config.runtime.pipeline_nice, own_step=own_step, stop_on_signal=not elastic)


def save_result(ctx: DistContext, config: Config, trainer: Trainer, metrics: dict, model, run_dir: str,
                watchdog: Watchdog) -> None:
    """Step 9, on rank 0: say why training stopped early, if it did; then the trained model as
    ``<run_dir>/model.keras`` (:func:`hvdtrain.outputs.save_trained_model`) and the line naming the
    run folder and its files, or an evaluation-only run's test metrics."""
    if not ctx.is_chief:
        return
    if trainer.stopped_after:
        say(f"hvdtrain: a callback stopped training after epoch {trainer.stopped_after} of {config.epochs}")
    if "train_examples" not in metrics:
        say(split_text(metrics, "test"))
    else:  # no stall: a large file takes long
        watchdog.pause("saving the trained model", 3600.0)
        save_trained_model(model, run_dir)
        say(run_folder_line(run_dir))


def agree_on_data(ctx: DistContext, fingerprint: dict) -> None:
    """Check that every rank loaded the same data as rank 0 (a collective).

    Args:
        ctx: this process's context.
        fingerprint: this rank's :meth:`hvdtrain.data.in_memory.Dataset.fingerprint`.

    Raises:
        FoundHere: on the lowest rank whose data differ from rank 0's, holding an HvdtrainError
            naming what differs (the other ranks raise :class:`PeerFailure`).
    """
    chief = ctx.broadcast_object(fingerprint, name="hvdtrain.data_fingerprint")
    ctx.agree(data_mismatch(ctx.rank, fingerprint, chief) if fingerprint != chief else None, "checking the data")


def refuse_own_step(model) -> None:
    """A model function's model with its own ``train_step`` is never trained by hvdtrain's step instead.

    Raises:
        HvdtrainError: naming the class, and how to train it by its own step.
    """
    if has_own_step(model):
        raise HvdtrainError(f"the model function's model trains by {step_name(model)}, which hvdtrain's image step "
                            f"would replace: build the model and pass the model object, hvdtrain.fit(model, ...), to "
                            f"train it by its own step")


def refuse_collectives_under_xla(model, world_size: int) -> None:
    """Refuse ``--xla`` for a model whose forward pass allreduces: XLA compiles the forward and
    backward pass, and Horovod's ops (built without its XLA ops) cannot be compiled.

    Raises:
        EveryRankError: naming the synchronized BatchNorm layers, at world size > 1.
    """
    synchronized = [layer.name for layer in sublayers(model)
                    if isinstance(layer, SyncBatchNormalizationBase) and layer.synchronized]
    if synchronized and world_size > 1:
        raise EveryRankError(f"--xla compiles the forward and backward pass, which cannot hold the allreduce of "
                             f"synchronized BatchNorm ({len(synchronized)} layers, e.g. {synchronized[0]}); use "
                             f"--no-sync-bn, or SyncBatchNormalization(synchronized=False) in your model")


def check_accumulation_fits_epochs(plan: ShardPlan, passes: int) -> None:
    """Refuse ``--backward-passes-per-step`` K unless the steps per epoch are a multiple of K.

    Horovod applies an update every K passes and keeps the passes since the last one in memory:
    an update spanning two epochs would cross the epoch's checkpoint and lose them.

    Raises:
        EveryRankError: suggesting the nearest local batch sizes that fit.
    """
    if plan.steps_per_epoch % passes == 0:
        return
    n, batch = plan.num_examples, plan.local_batch
    fitting = [b for b in range(1, 2 * batch)
               if ShardPlan(n, b, plan.world_size, plan.rank).steps_per_epoch % passes == 0]
    nearest = sorted(sorted(fitting, key=lambda b: abs(b - batch))[:2])
    hint = f"; --batch-size {' or '.join(map(str, nearest))} would do" if nearest else ""
    raise EveryRankError(f"--backward-passes-per-step {passes} needs the steps per epoch to be a multiple of "
                         f"{passes} so that no update spans two epochs; here they are {plan.steps_per_epoch} "
                         f"({n} examples / global batch {plan.global_batch}){hint}")
