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

After each restart :func:`train_elastic` re-runs the part of the recipe that depends on the world
size: the shard plan (continuing at the same example of the same epoch's permutation, so no
example is repeated or skipped), the learning rate (``base_lr · world_size``, warmup and decay
continued at the same point in epochs), the compiled step, the rank that keys dropout masks, and
the rank-0 callbacks (rank 0 may now be another process).
"""
from __future__ import annotations

import contextlib
import os
import time

from horovod.common.elastic import ObjectState

from hvdtrain import callbacks as cbs
from hvdtrain.checkpoint import CheckpointManager, check_resumable, require_checkpoint_dir
from hvdtrain.config import Config
from hvdtrain.data import data_mismatch
from hvdtrain.dist import DistContext, PeerFailure, is_peer_loss
from hvdtrain.errors import say
from hvdtrain.models import set_dropout_rank
from hvdtrain.optim import rescale_schedule
from hvdtrain.sharding import ShardPlan
from hvdtrain.stop import defer_stop_signals
from hvdtrain.watchdog import Watchdog


class TrainingState(ObjectState):
    """The state an elastic job commits, rolls back to, and sends to workers that join.

    Horovod's ``TensorFlowKerasState`` calls ``optimizer.variables()``, which Keras 2.11+
    optimizers no longer have; this keeps the same protocol (save/restore/sync) over an explicit
    list of variables.

    Args:
        model: the Keras model (built).
        optimizer: its optimizer, variables built.
        fingerprint: this worker's :meth:`hvdtrain.data.Dataset.fingerprint`; a sync checks it
            against rank 0's (kept as the attribute ``data``).
        **kwargs: plain Python values kept with the variables and exposed as attributes:
            ``epoch`` (completed epochs, int), ``example`` (position in that epoch's permutation,
            int), ``epoch_sums`` (the epoch's global ``[loss, correct, count]`` so far, or None),
            ``run_dir`` (str), ``dir_checked`` (bool), ``resume_pending`` (bool).
    """

    def __init__(self, model, optimizer, fingerprint: dict, **kwargs):
        import horovod.tensorflow as hvd

        self._variables = list(model.variables) + list(optimizer.variables)
        self._values = [v.numpy() for v in self._variables]
        self._fingerprint = fingerprint
        super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, data=fingerprint, **kwargs)

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
        import horovod.tensorflow as hvd

        with _peer_loss_as_reset():
            super().sync()  # the attributes first: rank 0's position and data fingerprint
            if self.data != self._fingerprint:
                raise data_mismatch(hvd.rank(), self._fingerprint, self.data)
            hvd.broadcast_variables(self._variables, root_rank=0)
            self._values = [v.numpy() for v in self._variables]


@contextlib.contextmanager
def _peer_loss_as_reset():
    """Turn the errors of a collective whose peer went away into Horovod's ``HorovodInternalError``.

    TensorFlow reports them as its own error types; Horovod's elastic loop rolls back and resets
    only on ``HorovodInternalError``. Any other error passes unchanged.
    """
    from horovod.common.exceptions import HorovodInternalError

    try:
        yield
    except (HorovodInternalError, PeerFailure):
        raise
    except Exception as e:  # noqa: BLE001
        if is_peer_loss(e) and not getattr(e, "rank_found", False):  # not an error every rank agreed on
            raise HorovodInternalError(f"{type(e).__name__}: {e}") from e
        raise


def _resume(config: Config, model, optimizer, fingerprint: dict) -> dict:
    """Rank 0: restore the latest checkpoint into ``model`` and ``optimizer``; return its position
    (the start, if the checkpoint directory holds none yet).

    The position is in examples, so the job may resume at any world size (but not with another
    local batch, seed or data).

    Raises:
        HvdtrainError: no checkpoint directory, an unreadable checkpoint, or one of another model,
            local batch, seed or data; no checkpoint, though the run's metrics record more than
            one epoch.
    """
    ckpt_dir = config.checkpoint.dir or os.path.join(config.log.dir, "checkpoints")
    require_checkpoint_dir(ckpt_dir)
    manager = CheckpointManager(ckpt_dir, model, optimizer, keep=config.checkpoint.keep)
    if manager.latest() is None:
        from hvdtrain.train import start_without_checkpoint  # (hvdtrain.train imports this module)

        start_without_checkpoint(ckpt_dir, config.log.dir)
        return {"epoch": 0, "example": 0, "epoch_sums": None}
    latest, meta = manager.restore_latest()
    check_resumable(latest, meta, {"batch_size": config.batch_size, "seed": config.seed, "data": fingerprint})
    num_examples = fingerprint["train_examples"]
    step = int(meta.get("step_in_epoch", 0))
    example = meta.get("example_in_epoch", min(step * meta["world_size"] * meta["batch_size"], num_examples))
    return {"epoch": int(meta["epoch"]), "example": int(example), "epoch_sums": meta.get("epoch_sums")}


def train_elastic(config: Config, ctx: DistContext, dataset, fingerprint: dict, model, optimizer,
                  watchdog: Watchdog) -> dict:
    """Steps 5-8 of :func:`hvdtrain.train.run` for an elastic job, re-run after every reset.

    Args:
        config: the run's config (``config.elastic.enabled``).
        ctx: this process's context as started; refreshed after each reset.
        dataset, model, optimizer: as built by :func:`hvdtrain.train.run` (not yet broadcast:
            the first state sync does that).
        fingerprint: ``dataset.fingerprint()``, checked against rank 0's at every state sync.
        watchdog: the stall watchdog (told of resets, which wait for the driver).

    Returns:
        The final metrics, as :meth:`Trainer.fit`.

    Raises:
        HvdtrainError: for bad checkpoints or directories, or an error in rank 0's writes, on
            rank 0 (which prints it); the other workers raise :class:`PeerFailure`, and the
            driver ends the job. (An error in a worker's own start-up, or data that differ from
            rank 0's, ends that worker only.)
    """
    import horovod.tensorflow as hvd
    from horovod.common.elastic import run_fn
    from horovod.common.exceptions import HostsUpdatedInterrupt

    from hvdtrain.train import Trainer, banner, broadcast_state, chief_callbacks, open_run_dir

    n = len(dataset.y_train)
    # A worker's own run directory name; rank 0's wins at the first sync.
    run_dir = config.log.dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    state = TrainingState(model, optimizer, fingerprint, epoch=0, example=0, epoch_sums=None, run_dir=run_dir,
                          dir_checked=config.checkpoint.resume, resume_pending=config.checkpoint.resume)

    def train_once(state: TrainingState) -> dict:
        """Steps 5-8 with the current workers, from the state's position (after a sync)."""
        here = ctx.refreshed()
        watchdog.beat("the first step after an elastic (re)start")
        watchdog.rank = here.rank
        set_dropout_rank(model, here.rank)  # the ranks were renumbered: keep dropout masks distinct
        if state.resume_pending:
            # Once per job, at its first start: rank 0 reads the checkpoint and sends it to all.
            # (Workers that join later receive resume_pending=False, and the state, by sync.)
            position = here.guarded("restoring the checkpoint", lambda: _resume(config, model, optimizer, fingerprint)
                                    if here.is_chief else None)
            vars(state).update(here.broadcast_object(position, name="hvdtrain.elastic.resume"))
            broadcast_state(here, model, optimizer)
            state.resume_pending = False
            state.save()
        plan = ShardPlan(n, config.batch_size, here.size, here.rank, seed=config.seed)
        # The learning rate follows the world size; warmup and decay continue where they were.
        schedule = rescale_schedule(optimizer, config.optim, here.size, plan.steps_per_epoch, config.epochs,
                                    epochs_done=state.epoch + state.example / n)
        callbacks = []
        try:
            ckpt_dir = config.checkpoint.dir or os.path.join(state.run_dir, "checkpoints")
            # Rank 0 (perhaps another process than before the reset) opens the run directory; all
            # ranks agree on the outcome (a collective: every rank is past the sync here).
            meta = {"model": config.model.name, "seed": config.seed, "data": fingerprint, "elastic": True,
                    "world_size": here.size,
                    "batch_size": config.batch_size, "steps_per_epoch": plan.steps_per_epoch,
                    "config": config.to_dict()}

            def open_for_rank_0():
                manager = open_run_dir(config, state.run_dir, ckpt_dir, model, optimizer, fresh=not state.dir_checked)
                return chief_callbacks(config, state.run_dir, manager, plan, optimizer, meta)

            callbacks = here.guarded("opening the run directory", open_for_rank_0 if here.is_chief else list)
            if not state.dir_checked:
                # Once per job: checkpoints found there later are this job's own. Saved on every
                # rank alike (the state is in sync), so a new rank 0 after a reset knows it too.
                state.dir_checked = True
                state.save()
            if here.is_chief:  # the rank-0 block
                say(banner(here, config, dataset, plan, schedule, model, state.run_dir, ckpt_dir,
                           state.epoch, plan.start_step(first_example=state.example)))
            callbacks.append(cbs.ElasticCommit(state, plan, config.epochs))
            trainer = Trainer(here, model, optimizer, dataset, plan, log_every=config.log.log_every,
                              eval_batch_size=config.data.eval_batch_size, callbacks=callbacks, watchdog=watchdog,
                              agree_on_side_effects=True)
            metrics = trainer.fit(state.epoch, config.epochs, start_sums=state.epoch_sums,
                                  start_example=state.example, checkpoint_every=config.checkpoint.every_steps,
                                  commit_every=config.elastic.commit_every)
            # Trained: while the callbacks close (below), SIGTERM is only recorded, as in run().
            defer_stop_signals()
            return metrics
        except HostsUpdatedInterrupt:
            # Sync after every change, also when workers only left: by the time the driver
            # re-forms the job a worker may have joined too, and it waits in the sync
            # (horovod/horovod#3494: skipping it there deadlocks).
            raise HostsUpdatedInterrupt(False) from None
        finally:
            cbs.close_all(callbacks)

    def train(state: TrainingState) -> dict:
        with _peer_loss_as_reset():  # a worker lost mid-collective: roll back and go on without it
            return train_once(state)

    def reset():
        # Waits for the driver to form the new set of workers (up to its elastic timeout, read as
        # the driver reads it), then for joining workers to start up: not a stall, up to that
        # long. The watchdog resumes at the next beat.
        from horovod.runner.elastic.driver import ELASTIC_TIMEOUT_SECS

        watchdog.pause("an elastic reset", float(os.environ.get("HOROVOD_ELASTIC_TIMEOUT", ELASTIC_TIMEOUT_SECS)))
        hvd.shutdown()
        hvd.init()

    try:
        return run_fn(train, reset)(state)
    except BaseException as e:
        e.run_dir = state.run_dir  # where hvdtrain.cli tells the user to --resume from, after Ctrl-C
        raise
