"""Stop signals: the first SIGTERM or SIGUSR1 raises, except where a rank already reports how it
ends, and inside the training loop, which stops every rank at one step (test_slurm.py, test_cli.py)."""
import os
import signal
import sys
import threading
import time

import pytest

from hvdtrain.runtime import signals


@pytest.fixture
def handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    state = (signals._received, signals._held, signals._interrupted, signals._raise, signals._arrived_at)
    signals.install_stop_handlers()
    yield
    for s, h in saved.items():
        signal.signal(s, h)
    signals._received, signals._held, signals._interrupted, signals._raise, signals._arrived_at = state


def test_the_first_sigterm_raises_and_later_ones_are_recorded(handlers):
    with pytest.raises(signals.Terminated):
        os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)  # recorded, not raised
    assert signals.sigterm_received() and signals.stop_requested()
    assert isinstance(signals.stop_exception(), signals.Terminated)


def test_sigusr1_stops_as_sigterm_does_and_its_name_is_kept(handlers):
    with pytest.raises(signals.Terminated):
        os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGTERM)
    assert signals.stop_signal() == "SIGUSR1" and signals.sigterm_received()


def test_inside_the_training_loop_a_stop_signal_is_only_recorded_and_ctrl_c_still_raises(handlers):
    with signals.stops_at_a_step():
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.stop_signal() == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


def test_an_error_after_a_held_signal_is_an_error_and_a_second_signal_cannot_replace_it(handlers):
    """A signal held by the loop cut into nothing: what the loop raises next (a full disk as the
    stop's checkpoint is written) ends the run as that error, not as a stop, and a second signal
    while it propagates is only recorded."""
    with pytest.raises(OSError):
        with signals.stops_at_a_step():
            os.kill(os.getpid(), signal.SIGUSR1)
            raise OSError("No space left on device")
    assert signals.stop_signal() == "SIGUSR1" and not signals.stop_requested()
    os.kill(os.getpid(), signal.SIGTERM)  # recorded, not raised
    assert signals.stop_signal() == "SIGUSR1"


def test_a_signal_raised_after_a_held_one_ends_the_run_as_a_stop(handlers):
    with signals.stops_at_a_step():
        os.kill(os.getpid(), signal.SIGTERM)
    assert not signals.stop_requested()  # the loop ended before a check: the run finishes
    with pytest.raises(signals.Terminated):
        os.kill(os.getpid(), signal.SIGTERM)  # in the save phase: raised
    assert signals.stop_requested()


def test_the_wakeup_socket_tells_any_thread_that_a_signal_arrived(handlers):
    """The watchdog thread reads it: the main thread may never return to Python to run the handler."""
    signals._arrived_at = None
    signals.signal_arrived()  # drains what earlier tests left
    signals._arrived_at = None
    with signals.stops_at_a_step():
        os.kill(os.getpid(), signal.SIGUSR1)
    seen = []
    thread = threading.Thread(target=lambda: seen.append(signals.signal_arrived()))
    thread.start()
    thread.join()
    assert seen[0] is not None and seen[0] <= time.monotonic()


def test_after_defer_stop_signals_nothing_raises(handlers):
    signals.defer_stop_signals()
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGINT)
    assert signals.sigterm_received() and signals.stop_requested()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_landing_as_defer_stop_signals_is_entered_is_only_recorded(handlers, signum):
    # Python runs a handler at the next function entry; the frame it passes is then that of
    # defer_stop_signals, called first thing in an ``except`` block (the race CI met).
    entered = []

    def on_call(frame, event, arg):
        if event == "call" and frame.f_code is signals.defer_stop_signals.__code__:
            entered.append(frame)

    sys.setprofile(on_call)
    try:
        signals.defer_stop_signals()
    finally:
        sys.setprofile(None)
    signals._raise = True
    handler = signal.getsignal(signum)
    try:
        handler(signum, entered[0])
    except KeyboardInterrupt:  # pytest would stop the session on it
        pytest.fail("the signal raised in defer_stop_signals, replacing the error being handled")
    assert signals.stop_requested()
    with pytest.raises(KeyboardInterrupt):
        handler(signum, sys._getframe())  # anywhere else it raises
