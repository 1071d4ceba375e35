"""Stopping every rank after the same step, on a signal that reached some of them.

A scheduler signals the ranks of a job at about the same time, but each receives it in the middle
of a different step (Slurm's ``scancel --signal=TERM``, its ``--signal=USR1@120`` before a time
limit, a launcher passing Ctrl-C on as SIGTERM). If each rank stopped where it was, the others
would wait in the next collective and nothing consistent could be saved. Instead, inside the
training loop a signal is only recorded (:func:`hvdtrain.runtime.signals.stops_at_a_step`), and
:class:`StopCheck` asks every rank at agreed steps: one allreduce of two numbers, whether any rank
received a signal and how many steps until the next check. Rank 0 proposes that interval from its
step time, so that a check comes about every :attr:`StopCheck.target_s` seconds whatever the step
costs (one tiny collective a second), and every rank then stops after the same step, where the
trainer writes a complete checkpoint and raises :class:`Stopped`.
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np

from hvdtrain.runtime.signals import Terminated, stop_signal


class Stopped(Terminated):
    """Every rank stopped after the same step on a stop signal; what resumes it was written.

    Args:
        signal_name: the first signal that reached a rank of this process (``"SIGUSR1"``), or
            None where it reached another rank only.
        where: the position, e.g. ``"epoch 2, step 118 of 469"``.
    """

    def __init__(self, signal_name: Optional[str], where: str):
        super().__init__(f"stopped by {signal_name or 'a signal to another rank'} after {where}")
        self.signal_name, self.where = signal_name, where


class StopCheck:
    """Whether to stop now, agreed by every rank (a collective at the steps it is due).

    Args:
        ctx: the job (:class:`hvdtrain.runtime.dist.DistContext`).
        target_s: seconds between checks that rank 0 aims for (from its mean step time since the
            last check); between 1 and ``max_interval`` steps apart.
        max_interval: at most this many steps between checks.
    """

    def __init__(self, ctx, target_s: float = 1.0, max_interval: int = 10_000):
        if target_s <= 0 or max_interval < 1:
            raise ValueError(f"StopCheck: target_s must be > 0 and max_interval >= 1, got {target_s}, {max_interval}")
        self.ctx, self.target_s, self.max_interval = ctx, float(target_s), int(max_interval)
        self._interval, self._steps, self._since = 1, 0, time.perf_counter()

    def agreed(self, may_check: bool = True) -> bool:
        """Count one step and, where a check is due and ``may_check`` (a step the run can stop
        after: not mid-accumulation), ask every rank.

        Every rank must call it after the same steps with the same ``may_check``: the interval it
        counts down is the one every rank received from the last check.

        Returns:
            True on every rank at the same call if any rank has received SIGTERM or SIGUSR1.
        """
        self._steps += 1
        if self._steps < self._interval or not may_check:
            return False
        now = time.perf_counter()
        proposal = 0.0
        if self.ctx.is_chief:
            per_step = (now - self._since) / self._steps
            proposal = float(np.clip(round(self.target_s / max(per_step, 1e-9)), 1, self.max_interval))
        stop, interval = self.ctx.allreduce_sum(np.array([stop_signal() is not None, proposal], np.float64),
                                                name="hvdtrain.stop_check")
        self._interval, self._steps, self._since = max(int(interval), 1), 0, time.perf_counter()
        return bool(stop > 0)
