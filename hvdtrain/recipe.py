"""The training recipe, start to end: init, pin, shard, scale LR, wrap optimizer, broadcast, train.

:func:`run` is the one path a training job takes, in Horovod's order; each step says why. Whatever
ends a run early is turned, once, into a :class:`~hvdtrain.errors.RunEnded` (:func:`hvdtrain.ending.run_ended`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, List, NamedTuple, Optional, Sequence, Union

import tensorflow as tf

from hvdtrain import callbacks as cbs
from hvdtrain import kerases
from hvdtrain.callbacks import split_text
from hvdtrain.chief import banner, chief_callbacks
from hvdtrain.checkpoint import completed_checkpoints
from hvdtrain.config import Config
from hvdtrain.data.datasets import Dataset, data_mismatch
from hvdtrain.data.loading import open_dataset
from hvdtrain.data.sharding import ShardPlan
from hvdtrain.elastic import ElasticJob
from hvdtrain.ending import run_ended
from hvdtrain.errors import Ending, EveryRankError, HvdtrainError, say
from hvdtrain.kerases import set_random_seed
from hvdtrain.keras_callbacks import KerasCallbacks, is_keras_callback
from hvdtrain.losses import get_loss
from hvdtrain.model import sync_bn_kernels
from hvdtrain.model.moving_statistics import sublayers
from hvdtrain.model.sync_bn import SyncBatchNormalizationBase
from hvdtrain.model.zoo import build_model
from hvdtrain.optim import build_optimizer, users_optimizer
from hvdtrain.outputs import save_trained_model
from hvdtrain.precision import DynamicLossScale, set_precision
from hvdtrain.rundir import (checkpoint_dir, checkpoint_meta, default_run_dir, open_run_dir,
                             restore_for_resume, write_run_config)
from hvdtrain.runtime.dist import DistContext, current_rank, init_distributed
from hvdtrain.runtime.signals import defer_stop_signals
from hvdtrain.runtime.watchdog import Watchdog
from hvdtrain.state import TrainPosition
from hvdtrain.task import build_objective, check_objective, expected_outputs, model_label
from hvdtrain.trainer import Trainer, broadcast_state


@dataclasses.dataclass(frozen=True)
class Parts:
    """What a Python caller (:func:`hvdtrain.fit`) gives in place of the config's names.

    Attributes:
        model: a built-in model's name or a function ``(input_shape=, num_classes=)`` -> model
            (:func:`hvdtrain.model.zoo.build_model`); None: ``config.model.name``.
        dataset: an in-memory :class:`~hvdtrain.data.datasets.Dataset`; None: ``config.data``.
        data_function: ``(function, what messages call it)``: a data function (or one made of
            ``tf.data`` datasets) for ``config.data`` of ``dataset: function``, used as it is.
        loss: a name, a Keras loss or a callable (:func:`hvdtrain.losses.get_loss`); None: ``config.task.loss``.
        metrics: names, :class:`~hvdtrain.metrics.Metric` objects or callables; None: ``config.task.metrics``.
        callbacks: more :class:`~hvdtrain.callbacks.Callback` objects (chief-only ones run on rank 0
            only) and Keras callbacks (:mod:`hvdtrain.keras_callbacks`).
        optimizer: a Keras optimizer of the caller's (of the model's Keras), its learning rate (or schedule) used as it
            is; None: ``config.optim``'s, on hvdtrain's warmup schedule scaled by world size."""

    model: Optional[Union[str, Callable]] = None
    dataset: Optional[Dataset] = None
    data_function: Optional[tuple] = None
    loss: Optional[Union[str, Callable]] = None
    metrics: Optional[Sequence] = None
    callbacks: Sequence[cbs.Callback] = ()
    optimizer: Optional[object] = None


class Outcome(NamedTuple):
    """A finished run: final metrics (the last epoch's, or the test set's), trained model, this rank."""

    metrics: dict
    model: object  # the trained Keras model (Keras 2 or 3)
    rank: int = 0


def run(config: Config, parts: Parts = Parts()) -> Outcome:
    """Train as configured on this rank; every rank of the job calls it.

    Args:
        config: the run's settings.
        parts: the caller's own model, data, loss, metrics and callbacks, where given.

    Raises:
        RunEnded: when the run fails or is stopped, on every rank, saying how this rank leaves
            (what it prints, its exit status; :mod:`hvdtrain.cli` acts on it).
    """
    # 1. Init and pin: Horovod up, this process on its own GPU or its own CPU cores. From the
    #    moment every rank is up (hvd.init), a rank left waiting for a stalled or unreachable
    #    peer -- in a start-up collective or in training -- aborts after --stall-timeout instead
    #    of hanging (the watchdog, armed by init_distributed).
    watchdog = Watchdog(current_rank, config.runtime.stall_timeout)
    ctx: Optional[DistContext] = None
    callbacks: List[cbs.Callback] = []
    job: Optional[ElasticJob] = None
    run_dir = None
    ending = None
    try:
        # hvdtrain's CPU kernels are custom ops, which XLA cannot compile.
        sync_bn_kernels.set_enabled(config.runtime.sync_bn_kernels and not config.compute.xla)
        ctx = init_distributed(threads=config.runtime.threads, use_gpu=not config.runtime.cpu,
                               stall_timeout=config.runtime.stall_timeout, elastic=config.elastic.enabled,
                               watchdog=watchdog, horovod_nice=config.runtime.horovod_nice,
                               horovod_cycle_time_ms=config.runtime.horovod_cycle_time_ms,
                               deterministic=config.runtime.deterministic)
        watchdog.arm("start-up")
        # Heartbeats to and from rank 0, so that a stall names the rank that stalled. (Not in an
        # elastic job: its ranks change, and Horovod's driver reports the workers it loses.)
        if not config.elastic.enabled:
            watchdog.connect(ctx)
        watchdog.beat("loading data")
        # Same seed everywhere; initial weights are broadcast from rank 0 anyway (step 6).
        set_random_seed(config.seed)

        # 2. Data: every rank opens the dataset (in memory, or streamed by tf.data), its labels
        #    read as the loss takes them; the plan gives each rank a disjoint shard per epoch and
        #    the same number of steps.
        loss = get_loss(config.task.loss if parts.loss is None else parts.loss, config.task.label_smoothing)
        dataset = parts.dataset or open_dataset(ctx, config.data, config.seed, watchdog, loss.labels,
                                                parts.data_function)
        metrics = config.task.metric_names if parts.metrics is None else parts.metrics
        objective = ctx.guarded("choosing the metrics", lambda: build_objective(loss, metrics, dataset))
        # The shard plan assumes every rank holds the same examples (same steps per rank,
        # disjoint shards): a host with another copy of the data would hang or overlap.
        fingerprint = dataset.fingerprint()
        if not config.elastic.enabled:  # an elastic job checks after each state sync instead
            agree_on_data(ctx, fingerprint)
        plan = ShardPlan(dataset.num_train, config.batch_size, ctx.size, ctx.rank, seed=config.seed)
        passes = config.optim.backward_passes_per_step
        if config.epochs > 0:
            check_accumulation_fits_epochs(plan, passes)
        if dataset.num_train < plan.global_batch:
            raise EveryRankError(f"{dataset.name}: {dataset.num_train} training examples are fewer than one global "
                                 f"batch ({ctx.size} ranks x --batch-size {config.batch_size}); use a smaller --batch-size")

        # 3. Model, on this rank's device, in the configured precision (float32 variables).
        watchdog.beat("building the model")
        set_precision(config.compute.precision)
        with tf.device(ctx.device):
            model = ctx.guarded("building the model", lambda: build_model(
                parts.model or config.model.name, dataset.input_shape, dataset.num_classes, sync_bn=config.model.sync_bn,
                seed=config.seed, rank=ctx.rank, convert_sync_bn=config.model.convert_sync_bn, world_size=ctx.size,
                keras=config.model.keras, **expected_outputs(loss, dataset)))
            ctx.guarded("checking the loss and metrics", lambda: check_objective(objective, model, dataset))
            # The model's Keras (2 or 3) is the run's: the caller's optimizer, loss and callbacks must share it.
            keras = kerases.module(ctx.guarded("checking the Keras objects", lambda: kerases.choose(
                kerases.version_of(model), model=model, optimizer=parts.optimizer, loss=parts.loss,
                callbacks=[cb for cb in parts.callbacks if is_keras_callback(cb)])))

            # 4. Optimizer: learning rate scaled by world size with warmup (a caller's own optimizer
            #    keeps its own); Horovod's wrapper averages gradients by allreduce. Its slots are
            #    built now so they can be broadcast.
            if parts.optimizer is None:
                optimizer, schedule = build_optimizer(config.optim, ctx.size, plan.steps_per_epoch, config.epochs,
                                                      model.trainable_variables, keras)
            else:
                optimizer, schedule = ctx.guarded("wrapping the optimizer", lambda: users_optimizer(
                    parts.optimizer, config.optim)), None
                optimizer.build(model.trainable_variables)
            # fp16's loss scale lives among the optimizer's variables: broadcast and checkpointed with them.
            loss_scale = DynamicLossScale(optimizer) if config.compute.precision == "fp16" else None
        if config.compute.xla:
            refuse_collectives_under_xla(model, ctx.size)

        if config.elastic.enabled:
            if any(not isinstance(cb, cbs.History) for cb in parts.callbacks) or parts.optimizer is not None:
                raise EveryRankError("an elastic job makes its callbacks anew at every reset and rescales hvdtrain's "
                                     "learning-rate schedule: hvdtrain.fit takes callbacks= and optimizer= only "
                                     "without elastic")
            # Steps 5-8, re-run whenever workers leave or join (hvdtrain.elastic); the job knows
            # its run directory (rank 0's, from the first sync).
            job = ElasticJob(config, ctx, dataset, fingerprint, model, optimizer, watchdog, loss_scale, objective)
            return Outcome(job.run(), model, current_rank())

        # 5. Run directory and checkpoints (rank 0 only writes), restored state on resume.
        run_dir = ctx.broadcast_object(config.log.dir or default_run_dir(), name="hvdtrain.run_dir")
        ckpt_dir = checkpoint_dir(config, run_dir)
        meta = checkpoint_meta(config, ctx.size, plan.steps_per_epoch, fingerprint)
        watchdog.beat("opening the run directory")
        manager, start = ctx.guarded(
            "opening the run directory",
            lambda: open_checkpoints(config, run_dir, ckpt_dir, model, optimizer, meta) if ctx.is_chief
            else (None, None))
        start = ctx.broadcast_object(start, name="hvdtrain.start")

        # 6. Broadcast: every rank starts from rank 0's weights and optimizer state (fresh or restored).
        watchdog.beat("broadcasting the initial state")
        broadcast_state(ctx, model, optimizer)

        # 7. Rank-0 side effects: banner, progress, logs, checkpoints -- the one chief-only block.
        if ctx.is_chief:
            say(banner(ctx, config, dataset, plan, schedule, model, run_dir, ckpt_dir, start, objective,
                       model_label(parts.model or config.model.name)))
            callbacks = chief_callbacks(config, run_dir, manager, plan, optimizer, meta)
        callbacks += [cb for cb in parts.callbacks if not is_keras_callback(cb) and (ctx.is_chief or not cb.chief_only)]
        if any(map(is_keras_callback, parts.callbacks)):  # every rank, first: a rate they set is checkpointed
            callbacks.insert(0, ctx.guarded("setting up the Keras callbacks", lambda: KerasCallbacks(
                [cb for cb in parts.callbacks if is_keras_callback(cb)], model, optimizer, ctx.is_chief,
                config.epochs, plan.steps_per_epoch)))

        # 8. Train: the same steps on every rank.
        watchdog.beat("the first training step")
        trainer = Trainer(ctx, model, optimizer, dataset, plan, log_every=config.log.log_every,
                          eval_batch_size=config.eval_batch_size, callbacks=callbacks, watchdog=watchdog,
                          backward_passes_per_step=passes, loss_scale=loss_scale, xla=config.compute.xla,
                          objective=objective)
        metrics = trainer.fit(start, config.epochs, save_every=(config.checkpoint.every_steps,))
        if ctx.is_chief and trainer.stopped_after:
            say(f"hvdtrain: a callback stopped training after epoch {trainer.stopped_after} of {config.epochs}")
        if ctx.is_chief and "train_loss" not in metrics:
            say(split_text(metrics, "test"))
        elif ctx.is_chief:  # the trained model, for hvdtrain.load_model (no stall: a large file takes long)
            watchdog.pause("saving the trained model", 3600.0)
            save_trained_model(model, run_dir)
        return Outcome(metrics, model, ctx.rank)
    except BaseException as e:  # noqa: BLE001 -- every way a run can end is classified, once
        # From here on, while this rank reports how it ends, SIGTERM is only recorded.
        defer_stop_signals()
        if job is not None:
            run_dir = job.run_dir
        resumable = run_dir if run_dir and completed_checkpoints(checkpoint_dir(config, run_dir)) else None
        ending = run_ended(e, ctx, watchdog, resumable)
        raise ending from e
    finally:
        # The run has ended, either way: while it closes its logs, SIGTERM is only recorded (a
        # scheduler's SIGTERM after the last checkpoint must not turn a finished run into a stopped one).
        defer_stop_signals()
        watchdog.close()
        cbs.close_all(callbacks)
        # Horovod's shutdown waits for every rank: not where this rank leaves at once.
        if ctx is not None and (ending is None or ending.ending not in (Ending.ALONE, Ending.INTERRUPTED,
                                                                        Ending.TERMINATED)):
            ctx.close()


def open_checkpoints(config: Config, run_dir: str, ckpt_dir: str, model, optimizer, meta: dict):
    """Rank 0: the checkpoint manager and the :class:`TrainPosition` to start from, restoring the
    latest checkpoint if ``--resume`` (the start, if the checkpoint directory holds none yet);
    then the run's ``config.yaml``.

    The checkpoint's layout (world size, local batch, steps per epoch, seed, the data's
    fingerprint: ``meta``'s) must be this run's: a resumed run continues the same sequence of
    global batches, so these cannot change.
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


def agree_on_data(ctx: DistContext, fingerprint: dict) -> None:
    """Check that every rank loaded the same data as rank 0 (a collective).

    Args:
        ctx: this process's context.
        fingerprint: this rank's :meth:`hvdtrain.data.datasets.Dataset.fingerprint`.

    Raises:
        FoundHere: on the lowest rank whose data differ from rank 0's, holding an HvdtrainError
            naming what differs (the other ranks raise :class:`PeerFailure`).
    """
    chief = ctx.broadcast_object(fingerprint, name="hvdtrain.data_fingerprint")
    ctx.agree(data_mismatch(ctx.rank, fingerprint, chief) if fingerprint != chief else None, "checking the data")


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
