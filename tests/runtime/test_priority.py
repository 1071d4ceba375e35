"""hvdtrain.runtime.priority: helper threads started behind the caller's priority."""
import os
import threading

import pytest

from hvdtrain.runtime.priority import call_at_nice


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_call_at_nice_runs_and_starts_threads_at_that_nice_and_leaves_the_caller_at_its_own():
    caller = _nice()
    seen = []

    def fn():
        thread = threading.Thread(target=lambda: seen.append(_nice()))
        thread.start()
        thread.join()
        return _nice()

    assert call_at_nice(19, fn) == 19 and seen == [19] and _nice() == caller
    with pytest.raises(KeyError, match="raised in the thread"):
        call_at_nice(19, lambda: {}["raised in the thread"])
    assert _nice() == caller
