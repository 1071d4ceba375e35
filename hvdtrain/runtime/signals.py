"""Stopping a run on purpose: Ctrl-C (SIGINT), SIGTERM and SIGUSR1.

``mpirun`` and ``horovodrun`` pass Ctrl-C on to the ranks as SIGTERM, one rank after another, and
they also send it to the other ranks when one rank dies; Slurm sends SIGTERM on ``scancel`` and at
preemption, and the signal of ``sbatch --signal`` (SIGUSR1 in ``launch/slurm.sbatch``) before a
time limit. Python's default for SIGTERM and SIGUSR1 is to die at once, silently.
:func:`install_stop_handlers` makes them raise :class:`Terminated` in the main thread instead, so a
run stops as on Ctrl-C: its ``finally`` blocks close the logs, rank 0 says where the run can be
resumed from, and no checkpoint is half-written (a save appears only by rename, :mod:`hvdtrain.checkpoint`).

While the training loop runs (:func:`stops_at_a_step`), SIGTERM and SIGUSR1 are only recorded: the
loop asks every rank at agreed steps (:class:`hvdtrain.runtime.stops.StopCheck`), so that all ranks
stop after the same step and checkpoint it. The C-level handler also writes to a wakeup socket, so
the watchdog thread learns of a signal even while the main thread waits inside a collective that
will never return (:func:`signal_arrived`).

Only the first SIGTERM raises, and only while the run is running: once a rank handles an error or
a stop (:func:`defer_stop_signals`), a SIGTERM is merely recorded, so that it cannot replace the error
being reported or cut the message short. Launchers follow up with SIGKILL anyway.
"""
from __future__ import annotations

import contextlib
import signal
import socket
import time
from typing import Iterator, Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Terminated(KeyboardInterrupt):
    """Raised in the main thread by SIGTERM or SIGUSR1 (after :func:`install_stop_handlers`)."""


_received: Optional[str] = None  # the first stop signal's name
_held = False  # the first stop signal came inside stops_at_a_step: recorded, raised nowhere
_interrupted = False
_raise = True
_at_a_step = False
_wakeup: Optional[socket.socket] = None
_wakeup_writer: Optional[socket.socket] = None  # kept open as long as the reader
_arrived_at: Optional[float] = None


def _may_raise(frame) -> bool:
    # Python runs a handler at the next function entry: a signal that lands as an ``except`` block
    # calls defer_stop_signals() runs it there, where raising would replace the error being handled.
    return _raise and (frame is None or frame.f_code is not defer_stop_signals.__code__)


def _on_stop_signal(signum, frame):
    global _received, _raise, _held
    if _received is None:
        _received, _held = signal.Signals(signum).name, _at_a_step
    if _may_raise(frame) and not _at_a_step:
        _held = False
        _raise = False
        raise Terminated()


def _on_sigint(signum, frame):
    global _interrupted
    _interrupted = True
    if _may_raise(frame):
        raise KeyboardInterrupt()


def install_stop_handlers() -> None:
    """From now on the first SIGTERM or SIGUSR1 raises :class:`Terminated` in the main thread
    (outside :func:`stops_at_a_step`), and Ctrl-C (SIGINT) raises ``KeyboardInterrupt`` as by
    default; all are recorded (:func:`stop_requested`).

    Raises:
        ValueError: if called from another thread than the main thread (Python's rule for signals).
    """
    global _wakeup, _wakeup_writer
    for signum in STOP_SIGNALS:
        signal.signal(signum, _on_stop_signal)
    signal.signal(signal.SIGINT, _on_sigint)
    if _wakeup is None:
        reader, writer = socket.socketpair()
        for end in (reader, writer):
            end.setblocking(False)
        # One byte per signal from the C-level handler, at once, whatever the main thread is doing.
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        _wakeup, _wakeup_writer = reader, writer


@contextlib.contextmanager
def stops_at_a_step() -> Iterator[None]:
    """Inside, SIGTERM and SIGUSR1 are only recorded (:func:`stop_signal`): the training loop
    stops every rank after the same step (:class:`hvdtrain.runtime.stops.StopCheck`). A signal
    that came before is acted on there too. Ctrl-C still raises at once."""
    global _at_a_step, _raise
    _at_a_step = True
    try:
        yield
    except BaseException:
        if _received is not None:  # a stop on its way out: a second signal must not replace it
            _raise = False
        raise
    finally:
        _at_a_step = False


def stop_signal() -> Optional[str]:
    """The name of the first SIGTERM or SIGUSR1 that arrived (``"SIGTERM"``), or None."""
    return _received


def signal_arrived() -> Optional[float]:
    """When (``time.monotonic()``) a signal first reached this process, or None: read from the
    wakeup socket, so it is known in any thread even while the main thread never returns to
    Python to run the handler (a collective whose peer is gone)."""
    global _arrived_at
    if _arrived_at is None and _wakeup is not None:
        try:
            if _wakeup.recv(64):
                _arrived_at = time.monotonic()
        except (BlockingIOError, OSError):
            pass
    return _arrived_at


def defer_stop_signals() -> None:
    """From now on SIGTERM and Ctrl-C are only recorded (:func:`stop_requested`), never raised: for
    code that reports how a rank ends, and after the run has finished."""
    global _raise
    _raise = False


def restore_default_sigterm() -> None:
    """SIGTERM and SIGUSR1 end the process again, as without hvdtrain: for a rank leaving through
    Horovod's shutdown at exit, which a launcher's SIGTERM must still be able to end."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)


def sigterm_received() -> bool:
    """Returns whether SIGTERM or SIGUSR1 has arrived (raised or only recorded)."""
    return _received is not None


def stop_requested() -> bool:
    """Returns whether Ctrl-C, or a SIGTERM or SIGUSR1 that was not only held by
    :func:`stops_at_a_step`, has arrived. After any, whatever the run raises ends it as that stop:
    the interrupt may have cut into TensorFlow (a save, an op's error) and come out as another
    exception. A held signal cuts into nothing: an error after it is an error (a full disk while
    the stop's checkpoint is written)."""
    return (_received is not None and not _held) or _interrupted


def stop_exception() -> KeyboardInterrupt:
    """The exception that stands for the stop that arrived: :class:`Terminated` or ``KeyboardInterrupt``."""
    return Terminated() if _received else KeyboardInterrupt()
