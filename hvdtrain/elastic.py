"""Elastic training: the job keeps training while workers leave and join (Horovod Elastic).

Start it with Horovod's elastic driver, which watches a host-discovery script and restarts the
collective layer whenever the set of workers changes::

    horovodrun -np 2 --min-np 1 --max-np 4 --host-discovery-script ./discover_hosts.sh \\
        python -m hvdtrain --elastic --log-dir runs/elastic

What happens, per Horovod's elastic recipe (https://horovod.readthedocs.io/en/stable/elastic_include.html):

* Every ``--commit-every`` steps, at every checkpoint and at every epoch end, each rank copies the model and optimizer
  variables and the position in the run (epoch, example within the epoch's permutation, the
  epoch's global metric sums) to host memory (:class:`TrainingState`).
* A worker dies: the others' next collective fails (``HorovodInternalError``); they roll back to
  the last commit, restart Horovod with the workers that are left, and continue.
* Workers join (the discovery script lists more slots): at the next commit every rank raises
  ``HostsUpdatedInterrupt``, Horovod restarts with the new workers, and they receive rank 0's
  state by broadcast before the first step. (Not at the last commit, the end of training: the job
  ends there.)

After each restart :class:`ElasticJob` re-runs the part of the recipe that depends on the world
size: the shard plan (continuing at the same example of the same epoch's permutation, so no
example is repeated or skipped), the learning rate (``base_lr · world_size``, warmup and decay
continued at the same point in epochs), the compiled step, the rank that keys dropout masks, and
the rank-0 callbacks (rank 0 may now be another process).
"""
from __future__ import annotations

import contextlib
import os
from typing import Optional

from horovod.common.elastic import ObjectState

from hvdtrain import callbacks as cbs
from hvdtrain.checkpoint import CheckpointManager, require_checkpoint_dir
from hvdtrain.config import Config
from hvdtrain.data.in_memory import data_mismatch
from hvdtrain.data.sharding import ShardPlan
from hvdtrain.errors import EveryRankError, FoundHere, PeerFailure, RunEnded, is_peer_loss
from hvdtrain.model.zoo import set_dropout_rank
from hvdtrain.optim import rescale_schedule
from hvdtrain.precision import DynamicLossScale
from hvdtrain.recipe_steps import (Parts, RankData, RunFiles, broadcast_state, make_trainer, rank_callbacks,
                                   save_result, state_variables)
from hvdtrain.rundir import (checkpoint_dir, checkpoint_meta, default_run_dir, open_run_dir, restore_for_resume,
                             write_run_config)
from hvdtrain.runtime import dist
from hvdtrain.runtime.dist import DistContext
from hvdtrain.runtime.signals import defer_stop_signals
from hvdtrain.runtime.watchdog import Watchdog
from hvdtrain.position import TrainPosition


class TrainingState(ObjectState):
    """The state an elastic job commits, rolls back to, and sends to workers that join.

    Horovod's ``TensorFlowKerasState`` calls ``optimizer.variables()``, which Keras 2.11+
    optimizers no longer have; this keeps the same protocol (save/restore/sync) over an explicit
    list of variables.

    Args:
        model: the Keras model (built).
        optimizer: its optimizer, variables built.
        fingerprint: this worker's :meth:`hvdtrain.data.in_memory.Dataset.fingerprint`; a sync
            checks it against rank 0's (kept as the attribute ``data``).
        **kwargs: plain Python values kept with the variables and exposed as attributes:
            ``position`` (:class:`TrainPosition`), ``run_dir`` (str), ``dir_checked`` (bool),
            ``resume_pending`` (bool).
    """

    def __init__(self, model, optimizer, fingerprint: dict, **kwargs):
        self._variables = state_variables(model, optimizer)
        self._values = [v.numpy() for v in self._variables]
        self._fingerprint = fingerprint
        super().__init__(bcast_object=dist.broadcast_object, get_rank=dist.current_rank, data=fingerprint, **kwargs)

    def save(self):
        """Copy the variables to host memory (a commit; local, no collective)."""
        self._values = [v.numpy() for v in self._variables]
        super().save()

    def restore(self):
        """Roll the variables and attributes back to the last commit."""
        for variable, value in zip(self._variables, self._values):
            variable.assign(value)
        super().restore()

    def sync(self):
        """Give every rank rank 0's variables and attributes (collective: the broadcasts).

        Raises:
            HorovodInternalError: if a worker is lost meanwhile (a joining worker that failed
                its start-up, or one that left because of its data), so that Horovod's elastic
                loop resets again without it.
            HvdtrainError: on a worker whose data differ from rank 0's (a host with another copy
                of the dataset, say): it leaves alone, before the variables (whose shapes may
                differ too) are broadcast.
        """
        with _peer_loss_as_reset():
            super().sync()  # the attributes first: rank 0's position and data fingerprint
            if self.data != self._fingerprint:
                raise data_mismatch(dist.current_rank(), self._fingerprint, self.data)
            dist.broadcast_variables(self._variables)
            self._values = [v.numpy() for v in self._variables]


@contextlib.contextmanager
def _peer_loss_as_reset():
    """Turn the errors of a collective whose peer went away into Horovod's ``HorovodInternalError``.

    TensorFlow reports them as its own error types; Horovod's elastic loop rolls back and resets
    only on ``HorovodInternalError``. Any other error passes unchanged, and so do the ranks'
    agreed errors (:class:`FoundHere`, :class:`PeerFailure`): every rank stops on those.
    """
    from horovod.common.exceptions import HorovodInternalError

    try:
        yield
    except (HorovodInternalError, FoundHere, PeerFailure, RunEnded):
        raise
    except Exception as e:  # noqa: BLE001
        if is_peer_loss(e):
            raise HorovodInternalError(f"{type(e).__name__}: {e}") from e
        raise


class ElasticJob:
    """Steps 5-9 of the recipe (:mod:`hvdtrain.recipe_steps`: restore, broadcast, rank-0 block,
    training, saving) for an elastic job, re-run with the workers there are after every reset.

    Args:
        config: the run's config (``config.elastic.enabled``).
        ctx: this process's context as started; refreshed after each reset.
        parts: the caller's parts; callbacks (but a History) and an optimizer are refused.
        data: step 2's data, the dataset in memory or an image folder (:mod:`hvdtrain.data.folder`);
            its plan is remade for the world size after every reset, and its fingerprint checked
            against rank 0's at every state sync.
        model, optimizer: as the recipe built them (not yet broadcast: the first state sync does that).
        watchdog: the stall watchdog (told of resets, which wait for the driver).
        loss_scale: fp16's :class:`~hvdtrain.precision.DynamicLossScale` (its variables are the
            optimizer's, so commits carry it), or None.

    Raises:
        EveryRankError: for the caller's callbacks or optimizer, which an elastic job cannot keep.
    """

    def __init__(self, config: Config, ctx: DistContext, parts: Parts, data: RankData, model, optimizer,
                 watchdog: Watchdog, loss_scale: Optional[DynamicLossScale] = None):
        if any(not isinstance(cb, cbs.History) for cb in parts.callbacks) or parts.optimizer is not None:
            raise EveryRankError("an elastic job makes its callbacks anew at every reset and rescales hvdtrain's "
                                 "learning-rate schedule: hvdtrain.fit takes callbacks= and optimizer= only "
                                 "without elastic")
        self.config, self.ctx, self.parts, self.data = config, ctx, parts, data
        self.model, self.optimizer, self.watchdog, self.loss_scale = model, optimizer, watchdog, loss_scale
        # A worker's own run directory name; rank 0's wins at the first sync.
        self.state = TrainingState(model, optimizer, data.fingerprint, position=TrainPosition(),
                                   run_dir=config.log.dir or default_run_dir(),
                                   dir_checked=config.checkpoint.resume, resume_pending=config.checkpoint.resume)

    @property
    def run_dir(self) -> Optional[str]:
        """The job's run directory (rank 0's, once the first sync has run)."""
        return self.state.run_dir

    def run(self) -> dict:
        """Train to the end, resetting whenever workers leave or join.

        Returns:
            The final metrics, as :meth:`Trainer.fit`.

        Raises:
            FoundHere: for bad checkpoints or directories, or an error in rank 0's writes, on
                rank 0 (which prints it); the other workers raise :class:`PeerFailure`, and the
                driver ends the job. (An error in a worker's own start-up, or data that differ
                from rank 0's, ends that worker only.)
        """
        from horovod.common.elastic import run_fn

        def train(state: TrainingState) -> dict:
            with _peer_loss_as_reset():  # a worker lost mid-collective: roll back and go on without it
                return self._train_once(state)

        return run_fn(train, self._reset)(self.state)

    def _resume(self, ctx: DistContext) -> TrainPosition:
        """Rank 0: restore the latest checkpoint into the model and optimizer; return its position.

        The position is in examples, so the job may resume at any world size (but not with
        another local batch, seed or data).
        """
        config = self.config
        ckpt_dir = checkpoint_dir(config, config.log.dir)
        require_checkpoint_dir(ckpt_dir)
        manager = CheckpointManager(ckpt_dir, self.model, self.optimizer, keep=config.checkpoint.keep)
        expected = {"batch_size": config.batch_size, "seed": config.seed, "data": self.data.fingerprint}
        return restore_for_resume(config, manager, config.log.dir, expected, self.data.dataset.num_train, elastic=True)

    def _train_once(self, state: TrainingState) -> dict:
        """Steps 5-9 with the current workers, from the state's position (after a sync)."""
        from horovod.common.exceptions import HostsUpdatedInterrupt

        config, model, optimizer = self.config, self.model, self.optimizer
        ctx = self.ctx.refreshed()
        self.watchdog.beat("the first step after an elastic (re)start")
        set_dropout_rank(model, ctx.rank)  # the ranks were renumbered: keep dropout masks distinct
        # 5. Restore, once per job at its first start: rank 0 reads the checkpoint; 6. broadcast
        # sends it to all. (Workers that join later receive resume_pending=False, and the state, by sync.)
        if state.resume_pending:
            position = ctx.guarded("restoring the checkpoint", lambda: self._resume(ctx) if ctx.is_chief else None)
            state.position = ctx.broadcast_object(position, name="hvdtrain.elastic.resume")
            broadcast_state(ctx, model, optimizer)
            state.resume_pending = False
            state.save()
        n = self.data.dataset.num_train
        data = self.data._replace(plan=ShardPlan(n, config.batch_size, ctx.size, ctx.rank, seed=config.seed))
        start = state.position
        # The learning rate follows the world size; warmup and decay continue where they were.
        schedule = rescale_schedule(optimizer, config.optim, ctx.size, data.plan.steps_per_epoch, config.epochs,
                                    epochs_done=start.epoch + start.example / n)
        # A step of another world size's plan means nothing here: continue at the example.
        start = TrainPosition(start.epoch, 0, start.example, start.epoch_sums, start.sums_layout)
        callbacks = []
        try:
            ckpt_dir = checkpoint_dir(config, state.run_dir)
            meta = checkpoint_meta(config, ctx.size, data.plan.steps_per_epoch, data.fingerprint, elastic=True)

            def open_for_rank_0():
                manager = open_run_dir(config, state.run_dir, ckpt_dir, model, optimizer, fresh=not state.dir_checked)
                write_run_config(config, state.run_dir)
                return manager

            # Rank 0 (perhaps another process than before the reset) opens the run directory; all
            # ranks agree on the outcome (a collective: every rank is past the sync here).
            manager = ctx.guarded("opening the run directory", open_for_rank_0 if ctx.is_chief else lambda: None)
            if not state.dir_checked:
                # Once per job: checkpoints found there later are this job's own. Saved on every
                # rank alike (the state is in sync), so a new rank 0 after a reset knows it too.
                state.dir_checked = True
                state.save()
            files = RunFiles(state.run_dir, ckpt_dir, manager, start, meta)
            # 7. Rank 0 only (perhaps another process than before the reset), and the commits.
            callbacks = rank_callbacks(ctx, config, self.parts, data, model, optimizer, schedule, files)
            callbacks.append(cbs.ElasticCommit(state, config.epochs))
            # 8. Train.
            trainer = make_trainer(ctx, config, data, model, optimizer, self.loss_scale, callbacks, self.watchdog,
                                   elastic=True)
            metrics = trainer.fit(start, config.epochs,
                                  save_every=(config.checkpoint.every_steps, config.elastic.commit_every))
            # Trained: while the callbacks close (below), SIGTERM is only recorded, as in the recipe.
            defer_stop_signals()
            # 9. Save.
            save_result(ctx, config, trainer, metrics, model, state.run_dir, self.watchdog)
            return metrics
        except HostsUpdatedInterrupt:
            # Sync after every change, also when workers only left: by the time the driver
            # re-forms the job a worker may have joined too, and it waits in the sync
            # (horovod/horovod#3494: skipping it there deadlocks).
            raise HostsUpdatedInterrupt(False) from None
        finally:
            cbs.close_all(callbacks)

    def _reset(self) -> None:
        """Between two attempts: wait for the driver to form the new set of workers and restart Horovod.

        That waits up to the driver's elastic timeout (read as the driver reads it), then for
        joining workers to start up: not a stall, up to that long. The watchdog resumes at the next beat.
        """
        from horovod.runner.elastic.driver import ELASTIC_TIMEOUT_SECS

        self.watchdog.pause("an elastic reset", float(os.environ.get("HOROVOD_ELASTIC_TIMEOUT", ELASTIC_TIMEOUT_SECS)))
        dist.restart_horovod(self.ctx)
