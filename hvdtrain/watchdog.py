"""Stall watchdog: a rank that makes no progress for too long aborts instead of hanging forever.

A collective waits for every rank. If one rank is frozen (``kill -STOP``, stuck reading data), lost
without its connections closing (a cut network link), or skipped a collective, the others wait
in it indefinitely: Gloo has timeouts, MPI's TCP transport has none. The trainer calls
:meth:`Watchdog.beat` after every step; if no beat comes for ``timeout`` seconds, the watchdog
prints where the rank is stuck and ends the process with exit status 3, so the launcher (which ends
the job when a rank fails) and every other rank stop too.

Horovod's own stall inspector is set to warn at half the timeout; on the coordinator (rank 0) it
names the ranks that have not submitted the awaited collective.
"""
from __future__ import annotations

import os
import sys
import threading
import time

EXIT_STALLED = 3


def configure_horovod_stall_check(timeout_s: float) -> None:
    """Before ``hvd.init()``: have Horovod report missing ranks at ``timeout_s / 2`` (user settings win)."""
    if timeout_s > 0:
        os.environ.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", str(max(1, int(timeout_s // 2))))


class Watchdog:
    """Ends the process if :meth:`beat` is not called for ``timeout_s`` seconds while armed.

    Args:
        rank: this process's rank (for the message).
        timeout_s: seconds without progress before aborting; 0 disables the watchdog.
        poll_s: how often the watchdog thread checks.
    """

    def __init__(self, rank: int, timeout_s: float, poll_s: float = 1.0):
        self.rank, self.timeout_s, self.poll_s = rank, float(timeout_s), poll_s
        self._last = time.monotonic()
        self._where = "starting"
        self._stop = threading.Event()
        self._thread = None

    def arm(self, where: str) -> None:
        """Start watching (idempotent); ``where`` says what the rank is doing now."""
        self.beat(where)
        if self.timeout_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="hvdtrain-watchdog", daemon=True)
            self._thread.start()

    def beat(self, where: str) -> None:
        """Record progress; ``where`` (e.g. ``"epoch 2, step 17"``) is reported if the next beat never comes."""
        self._last = time.monotonic()
        self._where = where

    def close(self) -> None:
        """Stop watching (call in ``finally``)."""
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                sys.stderr.write(
                    f"hvdtrain: error: rank {self.rank} made no progress for {idle:.0f} s after {self._where}: "
                    f"it is waiting in a collective for a rank that is stalled, lost or unreachable "
                    f"(Horovod's stall warnings on rank 0 name the missing ranks). Aborting; resume from the "
                    f"last checkpoint with --resume.\n")
                sys.stderr.flush()
                os._exit(EXIT_STALLED)
