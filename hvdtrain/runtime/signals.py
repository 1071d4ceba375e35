"""Stopping a run on purpose: Ctrl-C (SIGINT) and SIGTERM.

``mpirun`` and ``horovodrun`` pass Ctrl-C on to the ranks as SIGTERM, one rank after another, and
they also send it to the other ranks when one rank dies; Slurm sends it on ``scancel`` and before
preemption. Python's default for SIGTERM is to die at once, silently. :func:`install_stop_handlers`
makes it raise :class:`Terminated` in the main thread instead, so a run stops as on Ctrl-C: its
``finally`` blocks close the logs, rank 0 says where the run can be resumed from, and no checkpoint
is half-written (a save appears only by rename, :mod:`hvdtrain.checkpoint`).

Only the first SIGTERM raises, and only while the run is running: once a rank handles an error or
a stop (:func:`defer_stop_signals`), a SIGTERM is merely recorded, so that it cannot replace the error
being reported or cut the message short. Launchers follow up with SIGKILL anyway.
"""
from __future__ import annotations

import signal


class Terminated(KeyboardInterrupt):
    """Raised in the main thread by SIGTERM (after :func:`install_stop_handlers`)."""


_received = False
_interrupted = False
_raise = True


def _may_raise(frame) -> bool:
    # Python runs a handler at the next function entry: a signal that lands as an ``except`` block
    # calls defer_stop_signals() runs it there, where raising would replace the error being handled.
    return _raise and (frame is None or frame.f_code is not defer_stop_signals.__code__)


def _on_sigterm(signum, frame):
    global _received, _raise
    _received = True
    if _may_raise(frame):
        _raise = False
        raise Terminated()


def _on_sigint(signum, frame):
    global _interrupted
    _interrupted = True
    if _may_raise(frame):
        raise KeyboardInterrupt()


def install_stop_handlers() -> None:
    """From now on the first SIGTERM raises :class:`Terminated` in the main thread, and Ctrl-C
    (SIGINT) raises ``KeyboardInterrupt`` as by default; both are recorded (:func:`stop_requested`).

    Raises:
        ValueError: if called from another thread than the main thread (Python's rule for signals).
    """
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, _on_sigint)


def defer_stop_signals() -> None:
    """From now on SIGTERM and Ctrl-C are only recorded (:func:`stop_requested`), never raised: for
    code that reports how a rank ends, and after the run has finished."""
    global _raise
    _raise = False


def restore_default_sigterm() -> None:
    """SIGTERM ends the process again, as without hvdtrain: for a rank leaving through Horovod's
    shutdown at exit, which a launcher's SIGTERM must still be able to end."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def sigterm_received() -> bool:
    """Returns whether SIGTERM has arrived (raised or only recorded)."""
    return _received


def stop_requested() -> bool:
    """Returns whether SIGTERM or Ctrl-C has arrived. After either, whatever the run raises ends
    it as that stop: the interrupt may have cut into TensorFlow (a save, an op's error) and come
    out as another exception."""
    return _received or _interrupted


def stop_exception() -> KeyboardInterrupt:
    """The exception that stands for the stop that arrived: :class:`Terminated` or ``KeyboardInterrupt``."""
    return Terminated() if _received else KeyboardInterrupt()
