"""hvdtrain.dist with real ranks: Horovod's threads yield the CPU to the compute where that was
measured to help (world size 1, MPI) and keep their priority under Gloo."""
import re

import pytest

from tests.ranks import run_ranks


@pytest.mark.parametrize("np_, launcher, yields", [(1, "single", True), (2, "mpirun", True), (2, "gloo", False)])
def test_horovod_threads_yield_to_compute(np_, launcher, yields):
    out = run_ranks(np_, ["-m", "tests.workers.thread_priorities"], launcher=launcher, timeout=120).stdout
    counts = re.findall(r"rank (\d+): nice19=(\d+) nice0=(\d+)", out)
    assert sorted(int(r) for r, _, _ in counts) == list(range(np_)), out
    for _, niced, normal in counts:
        assert int(normal) > 0, out  # TensorFlow's and Python's own threads keep their priority
        assert (int(niced) > 0) is yields, out
