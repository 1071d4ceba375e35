"""When a rank's threads run: nice values that put helper threads behind the training step's.

A rank's compute threads share its cores with helpers: Horovod's background threads
(:func:`yield_to_compute`) and the input pipeline's (:func:`call_at_nice`, which starts them at a
lower priority). At nice 19 a helper runs whenever the step waits and takes little from it while
it computes. On Linux a nice value belongs to a thread.
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Callable, TypeVar

T = TypeVar("T")


def yield_to_compute(thread_ids, nice: int = 19) -> None:
    """Run Horovod's own threads (its background loop, MPI's and Gloo's helpers) at ``nice`` (19).

    They share a CPU rank's cores with TensorFlow's compute threads. Horovod's loop wakes every
    ``HOROVOD_CYCLE_TIME`` (0.1 ms here) to coordinate, even with nothing to do, and under MPI it
    busy-polls while waiting for a peer; at normal priority both preempt the compute. At nice 19
    they still run at once whenever the compute waits for them (an allreduce result), and take
    little CPU while it computes (``benchmarks/scaling.py`` measures it). Not under Gloo: its TCP
    transport needs the loop's prompt answers. ``nice`` 0 leaves them be (``--horovod-nice``).
    Best effort: a thread that cannot be reniced is left as it is.
    """
    for tid in thread_ids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:
            pass


def call_at_nice(nice: int, fn: Callable[[], T]) -> T:
    """``fn()``, called by a new thread at nice ``nice``, which the threads ``fn`` starts inherit.

    On Linux a nice value belongs to a thread, and a new thread inherits its starter's; an
    unprivileged thread may lower its priority but never raise it again, hence a thread of its own,
    and the caller keeps its priority. Elsewhere (a nice value per process) ``fn`` runs at the
    caller's, as it does where the priority cannot be set.

    Args:
        nice: the nice value, 0 (the caller's priority) to 19 (the lowest); a thread already
            lower keeps its own.
        fn: what to call, without arguments.

    Returns:
        What ``fn`` returns.

    Raises:
        What ``fn`` raises (re-raised in the caller).
    """
    outcome = {}

    def run():
        if sys.platform.startswith("linux"):
            try:  # 0: the calling thread, on Linux
                os.setpriority(os.PRIO_PROCESS, 0, max(nice, os.getpriority(os.PRIO_PROCESS, 0)))
            except OSError:
                pass
        try:
            outcome["value"] = fn()
        except BaseException as e:  # noqa: BLE001 -- re-raised in the caller
            outcome["error"] = e

    thread = threading.Thread(target=run, name="hvdtrain-at-nice", daemon=True)
    thread.start()
    thread.join()
    error = outcome.pop("error", None)
    if error is not None:
        try:
            raise error
        finally:
            del error  # its traceback holds fn's frames (an iterator and its threads): no cycle to keep them
    return outcome.pop("value")
