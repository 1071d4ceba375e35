"""How a run ends on this rank, for the command line and :func:`hvdtrain.fit` alike.

- :func:`run_scope` wraps a run: whatever ends it early is turned, once, into a
  :class:`~hvdtrain.errors.RunEnded` (:func:`run_ended`), and the run's callbacks, watchdog and
  Horovod are closed either way.
- :func:`leave` prints what this rank should of it and gives its exit status (or exits at once).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
import traceback
from typing import Iterator, List, Optional

from hvdtrain import callbacks as cbs
from hvdtrain.config import Config
from hvdtrain.errors import (Ending, EveryRankError, FoundHere, HvdtrainError, PeerFailure, PeerLost, RunEnded, is_peer_loss)
from hvdtrain.console import say
from hvdtrain.runtime.dist import DistContext, current_rank
from hvdtrain.runtime.signals import (Terminated, defer_stop_signals, restore_default_sigterm, sigterm_received,
                                      stop_exception, stop_requested, stop_signal)
from hvdtrain.runtime.stops import Stopped
from hvdtrain.runtime.watchdog import Watchdog

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process ended by Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM: stopped by SIGTERM or SIGUSR1 outside training (no step to stop after)
# Every rank stopped after one step, checkpointed (Stopped): sysexits' EX_TEMPFAIL ("try again
# later"), for a scheduler to requeue on (slurm.conf RequeueExit=75). Decided alike on every rank.
EXIT_STOPPED = 75
QUIET_EXIT_DELAY_S = 2.0


@dataclasses.dataclass
class RunScope:
    """What a running recipe holds that its end needs, filled in as the run gets them.

    Attributes:
        ctx: this process's context, once Horovod is up (closed at the end, where it may wait).
        callbacks: the run's callbacks, closed at the end.
        run_dir: the run directory, once known (where to ``--resume`` from).
        elastic_job: an elastic job (:class:`hvdtrain.elastic.ElasticJob`), which knows its run directory.
    """

    ctx: Optional[DistContext] = None
    callbacks: List[cbs.Callback] = dataclasses.field(default_factory=list)
    run_dir: Optional[str] = None
    elastic_job: Optional[object] = None
    own_step: Optional[object] = None


@contextlib.contextmanager
def run_scope(config: Config, watchdog: Watchdog, keep_horovod: bool = False) -> Iterator[RunScope]:
    """Run the recipe inside: every way it can end is classified once, and it closes either way.

    ``keep_horovod``: a run that ends well leaves Horovod running (``hvdtrain.fit``: the caller's
    code after it may use ``hvd.rank()``, or call ``fit`` again).

    Raises:
        RunEnded: when the run fails or is stopped, on every rank, saying how this rank leaves.
    """
    scope, ending = RunScope(), None
    try:
        yield scope
    except BaseException as e:  # noqa: BLE001 -- every way a run can end is classified, once
        # From here on, while this rank reports how it ends, SIGTERM is only recorded.
        defer_stop_signals()
        run_dir = scope.elastic_job.run_dir if scope.elastic_job is not None else scope.run_dir
        ending = run_ended(e, scope.ctx, watchdog, _resumable(config, run_dir))
        raise ending from e
    finally:
        # The run has ended, either way: while it closes its logs, SIGTERM is only recorded (a
        # scheduler's SIGTERM after the last checkpoint must not turn a finished run into a stopped one).
        defer_stop_signals()
        watchdog.close()
        cbs.close_all(scope.callbacks)
        precision = sys.modules.get("hvdtrain.precision")  # imported once the model was built
        if precision is not None:
            precision.restore_floatx()
        if scope.own_step is not None:  # the model's optimizers update by themselves again
            scope.own_step.exchange.restore()
        # Horovod's shutdown waits for every rank: not where this rank leaves at once.
        if scope.ctx is not None and not (keep_horovod and ending is None) and (
                ending is None or ending.ending not in (Ending.ALONE, Ending.INTERRUPTED, Ending.TERMINATED)):
            scope.ctx.close()


def leave(ended: RunEnded) -> int:
    """Print what this rank should of how the run ended (once per job) and return its exit
    status, or exit at once where Horovod's shutdown at exit would wait for peers that are gone
    or busy (:class:`~hvdtrain.errors.Ending`)."""
    defer_stop_signals()  # a SIGTERM now must not replace what is being reported
    if ended.ending in (Ending.INTERRUPTED, Ending.TERMINATED):
        if ended.message:
            say(ended.message, sys.stderr)
        else:  # rank 0 says where to resume: a launcher ends the job at the first rank's exit
            time.sleep(QUIET_EXIT_DELAY_S)
        if ended.ending is Ending.INTERRUPTED:
            os._exit(EXIT_INTERRUPTED)
        # Stopped is raised on every rank at once (not a rank's own view of its disk): one status.
        os._exit(EXIT_STOPPED if isinstance(ended.cause, Stopped) else EXIT_TERMINATED)
    restore_default_sigterm()  # as before the run: a launcher's SIGTERM ends a rank stuck in shutdown
    if ended.ending is Ending.QUIET:
        return quiet_exit()
    if ended.traceback:
        cause = ended.cause
        traceback.print_exception(type(cause), cause, cause.__traceback__)
    if ended.message:
        say(ended.message, sys.stderr)
    if ended.ending is Ending.ALONE:
        sys.stderr.flush()
        os._exit(EXIT_ERROR)  # without Horovod's shutdown at exit, which would wait for the peers
    return EXIT_ERROR


def quiet_exit() -> int:
    """Exit status for a rank that leaves printing the error to another: it waits a moment first,
    because launchers end the whole job when the first rank exits, which could otherwise cut off
    the printing rank before its message is out."""
    time.sleep(QUIET_EXIT_DELAY_S)
    return EXIT_ERROR


def run_ended(error: BaseException, ctx: Optional[DistContext], watchdog: Watchdog,
           run_dir: Optional[str]) -> RunEnded:
    """How this rank leaves the run ``error`` ended (``ctx`` is None if it ended in ``hvd.init``).

    Args:
        run_dir: the run directory to ``--resume`` from (it holds a complete checkpoint), or None.
    """
    if isinstance(error, RunEnded):
        return error
    if isinstance(error, PeerFailure):  # another rank found it and prints it
        return RunEnded(Ending.QUIET, error)
    if isinstance(error, KeyboardInterrupt) or stop_requested():
        # Ctrl-C or SIGTERM (hvdtrain.runtime.signals), also where the interrupt cut into
        # TensorFlow and came out as another error.
        stopped = _stopped(ctx, watchdog, error if isinstance(error, KeyboardInterrupt) else stop_exception(), run_dir)
        if isinstance(stopped, PeerLost):
            return _lost(stopped)
        return _interrupted(stopped, run_dir)
    if isinstance(error, FoundHere):  # this rank's own error, which every rank agreed on
        return _reported(error.error)
    if isinstance(error, EveryRankError):  # alike on every rank: the rank 0 of now prints it
        return RunEnded(Ending.REPORT if current_rank() == 0 else Ending.QUIET, error, f"hvdtrain: error: {error}")
    if isinstance(error, PeerLost):
        return _lost(error)
    if is_peer_loss(error):
        if ctx is None:  # lost before the watchdog could be asked (start-up)
            return _lost(PeerLost("another rank failed or was lost, so Horovod shut down. The launcher names the "
                                  "rank that failed first.", report=current_rank() == 0))
        lost = _peer_lost(ctx, watchdog, run_dir)
        return _interrupted(lost, run_dir) if isinstance(lost, Terminated) else _lost(lost)
    # An error of this rank alone: it prints it, and the peers learn from its heartbeat not to.
    # It must not wait for Horovod's shutdown, which needs every rank while the others are
    # mid-collective: it exits at once, which ends their collectives.
    watchdog.report_failure(f"{type(error).__name__}: {error}")
    if isinstance(error, HvdtrainError):
        return RunEnded(Ending.ALONE, error, f"hvdtrain: error: {error}")
    return RunEnded(Ending.ALONE, error, traceback=True)


def _reported(error: BaseException) -> RunEnded:
    """This rank prints ``error`` (one of the user's as a message, any other as its traceback)."""
    if isinstance(error, HvdtrainError):
        return RunEnded(Ending.REPORT, error, f"hvdtrain: error: {error}")
    return RunEnded(Ending.REPORT, error, traceback=True)


def _lost(error: PeerLost) -> RunEnded:
    return RunEnded(Ending.REPORT if error.report else Ending.QUIET, error, f"hvdtrain: error: {error}")


def _interrupted(interrupt: KeyboardInterrupt, run_dir: Optional[str]) -> RunEnded:
    """Ctrl-C, SIGTERM or SIGUSR1: the rank 0 of now (an elastic job's may not be the launcher's)
    says where the run can be resumed from."""
    terminated = isinstance(interrupt, Terminated) or sigterm_received()
    message = None
    if current_rank() == 0 and isinstance(interrupt, Stopped):
        resume = f"--resume --log-dir {run_dir}" if run_dir else "--resume"
        message = (f"hvdtrain: {interrupt}, every rank there, and checkpointed it: rerun the same command with "
                   f"{resume} to continue from there (a Slurm job requeued on exit status {EXIT_STOPPED} does)")
    elif current_rank() == 0:
        how = f"stopped by {stop_signal() or 'SIGTERM'} (a launcher's Ctrl-C, or the scheduler)" if terminated \
            else "interrupted"
        resume = (f"rerun the same command with --resume --log-dir {run_dir} to continue from the last one"
                  if run_dir else "nothing was written yet")
        message = f"hvdtrain: {how}; the checkpoints written so far are complete: {resume}"
    return RunEnded(Ending.TERMINATED if terminated else Ending.INTERRUPTED, interrupt, message, run_dir=run_dir)


def _peer_lost(ctx: DistContext, watchdog: Watchdog, run_dir: Optional[str]) -> BaseException:
    """The error for a collective that failed because a peer went away, naming it when known:
    :class:`PeerLost`, or :class:`Terminated` if the peer was stopped on purpose (a launcher
    passing Ctrl-C on, a scheduler's SIGTERM: this rank's own comes next)."""
    failed, lost, stopped = watchdog.lost_peers()
    if failed:  # that rank printed its own error
        return PeerLost(f"rank(s) {sorted(failed)} failed: {'; '.join(failed.values())}", report=False)
    if stopped and not lost:
        return Terminated()
    return lost_peer(ctx, lost, run_dir, claimed=watchdog.claim_report())


def lost_peer(ctx: DistContext, lost: List[int], run_dir: Optional[str], claimed: bool = True) -> PeerLost:
    """The one error that names the lost ranks, with where to resume from.

    Args:
        ctx: this rank's job.
        lost: the ranks whose processes ended without a word (empty: "another rank").
        run_dir: the run directory that holds a complete checkpoint, or None.
        claimed: whether the caller won this rank's one report (:meth:`Watchdog.claim_report`):
            rank 0 reports, or rank 1 if rank 0 was lost, and only the caller that claimed it.
    """
    who = f"rank {', '.join(map(str, lost))} was lost" if lost else "another rank failed or was lost"
    report = claimed and (ctx.is_chief or (0 in lost and ctx.rank == 1))
    resume = (f"Rerun the same command with --resume --log-dir {run_dir} to continue from its last checkpoint"
              if run_dir else "No checkpoint was written yet: rerun the same command to start again")
    return PeerLost(f"{who} mid-training (its process ended or became unreachable), so every rank stopped. "
                    f"{resume}.", report=report)


def end_job_on_lost_peer(config: Config, ctx: DistContext, watchdog: Watchdog, scope: RunScope) -> None:
    """A peer's process that ends without a word ends this rank within seconds, the lost rank
    named once (:meth:`Watchdog.end_job_on_lost_peer`): also where a collective would never return.

    Args:
        config: the run's settings (where its checkpoints are).
        ctx: this rank's job.
        watchdog: this rank's watchdog, already connected to its peers.
        scope: the running recipe (its run directory, once known).
    """
    def describe(lost: List[int]):
        error = lost_peer(ctx, lost, _resumable(config, scope.run_dir))
        return error.report, f"hvdtrain: error: {error}"

    watchdog.end_job_on_lost_peer(describe)


def _resumable(config: Config, run_dir: Optional[str]) -> Optional[str]:
    """``run_dir`` if it holds a complete checkpoint to ``--resume`` from, else None."""
    from hvdtrain.checkpoint import completed_checkpoints  # TensorFlow: imported by the run already
    from hvdtrain.rundir import checkpoint_dir

    return run_dir if run_dir and completed_checkpoints(checkpoint_dir(config, run_dir)) else None


def _stopped(ctx: Optional[DistContext], watchdog: Watchdog, interrupt: KeyboardInterrupt,
             run_dir: Optional[str]) -> BaseException:
    """Ctrl-C or SIGTERM on this rank: the peers learn that it stops on purpose.

    A launcher also sends SIGTERM to the other ranks when one rank dies or fails, so that rank is
    named (:func:`_peer_lost`) instead of the stop: at once when it failed with its own error or
    its process on this host has ended, after :meth:`Watchdog.lost_peers`' wait of heartbeat
    silence for another host.

    Returns:
        ``interrupt``, or the :class:`PeerLost` naming the failed or lost rank.
    """
    if ctx is None or ctx.size == 1:
        return interrupt
    watchdog.report_stopped()
    failed, lost, _ = watchdog.lost_peers()
    return _peer_lost(ctx, watchdog, run_dir) if failed or lost else interrupt
