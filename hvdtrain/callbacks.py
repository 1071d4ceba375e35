"""Side effects of training (printing, logging, checkpointing), as callbacks.

Callbacks marked ``chief_only = True`` run on rank 0 only: :mod:`hvdtrain.chief` creates them for
the recipe's one rank-0 block and :class:`hvdtrain.trainer.Trainer` refuses them on other ranks. No chief-only
callback runs a collective, so what they do cannot desynchronise the ranks; the one callback that
does (:class:`ElasticCommit`) runs on every rank at the same points.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import List, Optional, Tuple

from hvdtrain.errors import HvdtrainError
from hvdtrain.console import say
from hvdtrain.files import replace_file
from hvdtrain.position import TrainPosition


class Callback:
    """Hooks called by :class:`hvdtrain.trainer.Trainer`. All metrics are already global (exact over ranks).

    ``epoch`` and ``step`` are 0-based, as in Keras (the console's "epoch 3/12" is ``epoch == 2``).
    Set ``stop_training = True`` (on any rank) in :meth:`on_epoch_end` to stop every rank after
    that epoch, as Keras' ``model.stop_training``.
    """

    chief_only = True
    stop_training = False

    def on_train_begin(self, start_epoch: int, epochs: int) -> None: ...

    def on_epoch_begin(self, epoch: int, steps: int, first_step: int = 0) -> None:
        """``steps`` per epoch; a resumed epoch begins at ``first_step``."""

    def on_step_end(self, epoch: int, step: int, running: Optional[dict]) -> None:
        """``running`` holds the global running ``loss`` and metrics (:meth:`Objective.results`) on
        steps where they were reduced, else None."""

    def on_save_point(self, position: TrainPosition) -> None:
        """A save point within an epoch (``Trainer.fit``'s ``save_every``), at ``position``, whose
        ``epoch_sums`` are the epoch's global objective sums so far (:class:`~hvdtrain.task.Objective`)."""

    def on_stop(self, position: TrainPosition) -> None:
        """Every rank stops at ``position`` (mid-epoch) on a stop signal (SIGTERM, SIGUSR1):
        write what resumes the run there (:mod:`hvdtrain.runtime.stops`). Called after this
        step's :meth:`on_save_point`, if it is one."""

    def on_epoch_end(self, epoch: int, metrics: dict) -> None: ...

    def on_train_end(self) -> None:
        """After the last epoch trained (on every rank), before the trained model is saved."""

    def on_evaluation_only(self, position: TrainPosition, metrics: dict) -> None:
        """A run with nothing left to train evaluated the model at ``position``."""

    def after_agreement(self) -> None:
        """Elastic jobs: after every rank agreed on rank 0's writes at a checkpoint hook (non-chief callbacks)."""

    def close(self) -> None: ...


class History(Callback):
    """Every rank keeps each trained epoch's metrics (global, so alike on every rank), in order:
    ``history[i]`` is epoch ``epochs[i]``'s dict (``train_loss``, ``test_<metric>``, ``lr``...).
    An epoch trained again (an elastic job rolled back to before its end) replaces its entry."""

    chief_only = False

    def __init__(self):
        self.epochs: List[int] = []
        self.history: List[dict] = []

    def on_epoch_end(self, epoch, metrics):
        if epoch in self.epochs:
            del self.history[self.epochs.index(epoch):], self.epochs[self.epochs.index(epoch):]
        self.epochs.append(epoch)
        self.history.append(dict(metrics))


class ProgressBar(Callback):
    """A tqdm bar per epoch with the global running loss and metrics, shown only when stderr is
    a terminal: under a launcher or in a batch job's log its redraws would pile up as lines."""

    def __init__(self):
        self._bar = None

    def on_epoch_begin(self, epoch, steps, first_step=0):
        from tqdm import tqdm

        self._bar = tqdm(total=steps, initial=first_step, desc=f"epoch {epoch + 1}", unit="step", leave=False,
                         file=sys.stderr, dynamic_ncols=True, mininterval=1.0, disable=None)

    def on_step_end(self, epoch, step, running):
        self._bar.update(1)
        if running:
            self._bar.set_postfix({_SHORT.get(k, k): f"{v:.4f}" for k, v in running.items() if k != "count"},
                                  refresh=False)

    def on_epoch_end(self, epoch, metrics):
        self.close()

    def close(self):
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class EpochLine(Callback):
    """One line per epoch on stdout; throughput in ``unit`` (``img/s``, or ``ex/s`` for examples that
    are not images)."""

    def __init__(self, epochs: int, unit: str = "img/s"):
        self.epochs, self.unit = epochs, unit

    def on_epoch_end(self, epoch, m):
        test = f"{split_text(m, 'test')}  " if any(k.startswith("test_") for k in m) else ""  # a run may have none
        say(f"epoch {epoch + 1:>3}/{self.epochs}  {split_text(m, 'train')}  {test}"
            f"{m['images_per_sec']:,.0f} {self.unit}  {m['epoch_time_s']:.1f} s  lr {m['lr']:.4g}")


_SHORT = {"accuracy": "acc"}  # names shortened in the lines printed


def split_text(metrics: dict, split: str) -> str:
    """``"train loss 0.3120 acc 0.8870"``: the loss and metrics of ``split`` in an epoch's ``metrics``
    (its ``<split>_<name>`` keys, ``train_examples`` aside)."""
    names = [key[len(split) + 1:] for key in metrics if key.startswith(f"{split}_") and key != "train_examples"]
    return " ".join([split] + [f"{_SHORT.get(name, name)} {metrics[f'{split}_{name}']:.4f}" for name in names])


def logged_epochs(path: str) -> List[Tuple[int, str]]:
    """The lines of a ``metrics.jsonl`` as ``(epoch, line)``, in file order, each line ending in a newline.

    A line that is not a JSON object with a numeric ``"epoch"`` (one cut short by a crash during
    its append) is skipped; an object without ``"epoch"`` counts as epoch 0.

    Raises:
        OSError: if ``path`` cannot be read.
    """
    logged = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
                epoch = int(record.get("epoch", 0))
            except (ValueError, TypeError, AttributeError):
                continue
            logged.append((epoch, line if line.endswith("\n") else line + "\n"))
    return logged


class JsonlMetrics(Callback):
    """Appends one JSON object per epoch to ``<log_dir>/metrics.jsonl``; a run with no epoch to
    train writes its test metrics to ``<log_dir>/evaluation.json`` instead (replaced atomically).

    On a resumed run, lines of epochs after the resumed one (written by the interrupted run after
    its last checkpoint) are dropped first, so the file holds each epoch once.
    """

    def __init__(self, log_dir: str):
        self.path = os.path.join(log_dir, "metrics.jsonl")
        self.evaluation_path = os.path.join(log_dir, "evaluation.json")

    def on_train_begin(self, start_epoch, epochs):
        if not os.path.exists(self.path):
            return
        kept = [line for epoch, line in logged_epochs(self.path) if epoch <= start_epoch]
        replace_file(self.path, "".join(kept))

    def on_epoch_end(self, epoch, metrics):
        with open(self.path, "a") as f:
            f.write(json.dumps({"epoch": epoch + 1, **metrics}) + "\n")

    def on_evaluation_only(self, position, metrics):
        replace_file(self.evaluation_path, json.dumps({**position.to_meta(sums=False), **metrics}) + "\n")


class TensorBoard(Callback):
    """Scalars for TensorBoard under ``<log_dir>/tensorboard``: running metrics by global step in
    ``steps/``, epoch metrics by epoch in ``epochs/`` (two TensorBoard runs, one per step axis).

    A resumed run repeats the steps and the epoch after its checkpoint, which the interrupted run
    may have logged already (after its last checkpoint, or before a save that failed). With
    ``restart_markers``, at the start of each epoch this callback writes TensorBoard's restart
    marker, a ``SessionLog`` START event at the first step and epoch it is about to log (the
    convention of TF1's ``FileWriter``), and TensorBoard's Python event loader
    (``--load_fast=false``) drops the earlier points at or after them instead of plotting both. (The
    marker drops every point of its run at or after its step, hence one run per step axis.)
    TensorBoard's default, faster loader ignores the marker, but keeps one point per step of a tag,
    the later. The events are written with TensorBoard's own ``EventFileWriter``.

    Args:
        log_dir: the run directory; events go to ``log_dir/tensorboard/{steps,epochs}``.
        steps_per_epoch: steps per epoch, to number the running metrics by global step.
        restart_markers: write the markers. Not in an elastic job: its steps per epoch change
            with its world size, so its global steps are no fixed axis, and a marker could drop
            points of epochs that are done.
    """

    def __init__(self, log_dir: str, steps_per_epoch: int, restart_markers: bool = True):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        root = os.path.join(log_dir, "tensorboard")
        self._writers = {axis: EventFileWriter(os.path.join(root, axis)) for axis in ("steps", "epochs")}
        self._steps_per_epoch = steps_per_epoch
        self._restart_markers = restart_markers

    def _write(self, axis: str, step: int, **fields) -> None:
        from tensorboard.compat.proto.event_pb2 import Event

        self._writers[axis].add_event(Event(wall_time=time.time(), step=step, **fields))

    def _scalars(self, axis: str, step: int, values: dict) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        self._write(axis, step, summary=Summary(
            value=[Summary.Value(tag=tag, simple_value=float(value)) for tag, value in values.items()]))

    def on_epoch_begin(self, epoch, steps, first_step=0):
        if not self._restart_markers:
            return
        from tensorboard.compat.proto.event_pb2 import SessionLog

        # Nothing at or after these steps is this run's yet: TensorBoard drops what is there.
        self._write("steps", epoch * self._steps_per_epoch + first_step + 1,
                    session_log=SessionLog(status=SessionLog.START))
        self._write("epochs", epoch + 1, session_log=SessionLog(status=SessionLog.START))

    def on_step_end(self, epoch, step, running):
        if running:
            self._scalars("steps", epoch * self._steps_per_epoch + step + 1,
                          {f"running/{name}": value for name, value in running.items() if name != "count"})

    def on_epoch_end(self, epoch, metrics):
        self._scalars("epochs", epoch + 1, {f"epoch/{key}": value for key, value in metrics.items()})
        for writer in self._writers.values():
            writer.flush()

    def close(self):
        for writer in self._writers.values():
            writer.close()


def close_all(callbacks: List[Callback]) -> None:
    """Close every callback, even when one fails (a full disk while flushing logs, say): a failure
    is printed as a warning, so that it neither keeps the others open nor replaces the error (or
    the result) the run ends with. Checkpoints and ``metrics.jsonl`` are written before this."""
    for cb in callbacks:
        try:
            cb.close()
        except Exception as e:  # noqa: BLE001 -- reported, not raised (see above)
            say(f"hvdtrain: warning: closing {type(cb).__name__} failed: {type(e).__name__}: {e}", sys.stderr)


class Checkpointer(Callback):
    """Saves checkpoints at the end of every epoch, and every ``every_steps`` steps within epochs
    (rank 0 only; the state is identical on all ranks).

    Checkpoints are tagged by ``global_step`` (the optimizer's iteration count, which keeps
    growing when an elastic job changes its steps per epoch; only an elastic rollback to an
    earlier commit rewinds it); ``epoch`` in the metadata counts completed epochs,
    ``step_in_epoch`` and ``example_in_epoch`` the position within the next.
    """

    def __init__(self, manager, meta: dict, global_step, every_steps: int = 0):
        self.manager = manager
        self.meta = meta
        self.global_step = global_step
        self.every_steps = every_steps

    def on_save_point(self, position):
        if not self.every_steps or position.step % self.every_steps:
            return  # a save point of another kind (an elastic commit)
        self._save(meta={**self.meta, **position.to_meta()})

    def on_stop(self, position):
        if not self.every_steps or position.step % self.every_steps:  # else on_save_point saved it
            self._save(meta={**self.meta, **position.to_meta()})

    def on_epoch_end(self, epoch, metrics):
        self._save(meta={**self.meta, **TrainPosition(epoch + 1).to_meta(), "metrics": metrics})

    def _save(self, meta):
        import tensorflow as tf

        tag = int(self.global_step.numpy())
        try:
            self.manager.save(tag=tag, meta=meta)
        except (OSError, tf.errors.OpError) as e:  # disk full, directory removed...: earlier checkpoints are intact
            lines = [line for line in str(e).splitlines() if line.strip()]
            reason = lines[0] if lines else type(e).__name__
            raise HvdtrainError(f"cannot write checkpoint {tag} in {self.manager.directory}: {reason}") from None


class ElasticCommit(Callback):
    """Commits the elastic training state in host memory on every rank (Horovod Elastic).

    After a worker is lost, every rank rolls back to the last commit; a commit is also where a
    rank learns that workers joined or left (``HostsUpdatedInterrupt``, raised on every rank at
    the same commit: the check is a broadcast from rank 0). A commit has two halves, which
    :meth:`hvdtrain.trainer.Trainer._write_hook` calls around the ranks' agreement on rank 0's
    writes: the hook saves the state (local), :meth:`after_agreement` checks for host updates
    (a collective). So a worker lost during rank 0's checkpoint write rolls the others back to
    the state of that checkpoint, not to an earlier one.

    The trainer calls :meth:`on_save_point` every ``--commit-every`` steps and at
    checkpoint steps, and each call commits: so a rollback never returns to a state older than a
    checkpoint on disk, and the run's checkpoints stay one timeline, their tags (global steps)
    increasing. The last commit, at the end of training, does not check for host updates: the job
    ends there, and a reset would only re-enter training to evaluate once more.

    Args:
        state: the :class:`hvdtrain.elastic.TrainingState`.
        epochs: the run's total epochs.
    """

    chief_only = False

    def __init__(self, state, epochs: int):
        self.state, self.epochs = state, epochs
        self._check_hosts = False

    def on_save_point(self, position):
        self._commit(position, check_hosts=True)

    def on_epoch_end(self, epoch, metrics):
        self._commit(TrainPosition(epoch + 1), check_hosts=epoch + 1 < self.epochs)

    def _commit(self, position: TrainPosition, check_hosts: bool):
        self.state.position = position
        self.state.save()
        self._check_hosts = check_hosts

    def after_agreement(self) -> None:
        """The second half of a commit: raises ``HostsUpdatedInterrupt`` on every rank alike if
        workers joined or left (a broadcast; called on every rank at the same points)."""
        if self._check_hosts:
            self._check_hosts = False
            self.state.check_host_updates()
