"""Stop signals: the first SIGTERM raises, except where a rank already reports how it ends."""
import os
import signal
import sys

import pytest

from hvdtrain.runtime import signals


@pytest.fixture
def handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    state = (signals._received, signals._interrupted, signals._raise)
    signals.install_stop_handlers()
    yield
    for s, h in saved.items():
        signal.signal(s, h)
    signals._received, signals._interrupted, signals._raise = state


def test_the_first_sigterm_raises_and_later_ones_are_recorded(handlers):
    with pytest.raises(signals.Terminated):
        os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)  # recorded, not raised
    assert signals.sigterm_received() and signals.stop_requested()
    assert isinstance(signals.stop_exception(), signals.Terminated)


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
