"""How a run that did not finish ends on this rank: what it prints and how it leaves
(:class:`~hvdtrain.errors.RunEnded`), decided once from whatever ended it (:func:`run_ended`)."""
from __future__ import annotations

from typing import Optional

from hvdtrain.errors import (Ending, EveryRankError, FoundHere, HvdtrainError, PeerFailure, PeerLost, RunEnded,
                             is_peer_loss)
from hvdtrain.runtime.dist import DistContext, current_rank
from hvdtrain.runtime.signals import Terminated, sigterm_received, stop_exception, stop_requested
from hvdtrain.runtime.watchdog import Watchdog


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
    """Ctrl-C or SIGTERM: the rank 0 of now (an elastic job's may not be the launcher's) says where
    the run can be resumed from."""
    terminated = isinstance(interrupt, Terminated) or sigterm_received()
    message = None
    if current_rank() == 0:
        how = "stopped by SIGTERM (a launcher's Ctrl-C, or the scheduler)" if terminated else "interrupted"
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
    who = f"rank {', '.join(map(str, lost))} was lost" if lost else "another rank failed or was lost"
    report = ctx.is_chief or (0 in lost and ctx.rank == 1)
    resume = (f"Rerun the same command with --resume --log-dir {run_dir} to continue from its last checkpoint"
              if run_dir else "No checkpoint was written yet: rerun the same command to start again")
    return PeerLost(f"{who} mid-training (its process ended or became unreachable), so Horovod shut down on "
                    f"every rank. {resume}.", report=report)


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
