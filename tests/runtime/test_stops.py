"""StopCheck's schedule: a check about every target_s seconds, only where the run may stop, and
the stop agreed. (Real ranks stopping at one step: test_slurm.py and test_cli.py.)"""
import time

import pytest

from hvdtrain.runtime import signals
from hvdtrain.runtime.dist import DistContext
from hvdtrain.runtime.stops import StopCheck, Stopped


class Counted(DistContext):
    """The world of this process alone (allreduce_sum returns the local values), counting the checks."""

    def allreduce_sum(self, values, name):
        self.calls.append(list(values))
        return super().allreduce_sum(values, name)


@pytest.fixture
def one_process():
    ctx = Counted(rank=0, local_rank=0, size=1, local_size=1, cross_size=1, device="/CPU:0", cpu_cores=(0,),
                  intra_op_threads=1)
    object.__setattr__(ctx, "calls", [])
    return ctx


def test_the_first_check_is_after_one_step_then_about_every_target_seconds(one_process):
    calls = one_process.calls
    check = StopCheck(one_process, target_s=0.05)
    time.sleep(0.01)
    assert not check.agreed()  # step 1: a check, which proposes the next interval from its time
    assert len(calls) == 1
    for _ in range(200):
        time.sleep(0.001)
        check.agreed()
    # Steps of about 1 ms and more: about one check per 50 ms, never one per step.
    assert 2 <= len(calls) <= 60, len(calls)
    assert all(c[1] >= 1 for c in calls)


def test_a_check_waits_for_a_step_the_run_may_stop_after(one_process, monkeypatch):
    monkeypatch.setattr(signals, "_received", "SIGTERM")
    check = StopCheck(one_process)
    assert not check.agreed(may_check=False)  # mid-accumulation: counted, not asked
    assert check.agreed(may_check=True)


def test_stopped_says_where_and_is_a_stop(one_process):
    stop = Stopped("SIGUSR1", "epoch 2, step 5 of 47")
    assert isinstance(stop, signals.Terminated) and str(stop) == "stopped by SIGUSR1 after epoch 2, step 5 of 47"
    assert str(Stopped(None, "epoch 1")) == "stopped by a signal to another rank after epoch 1"
    with pytest.raises(ValueError, match="target_s"):
        StopCheck(one_process, target_s=0)
