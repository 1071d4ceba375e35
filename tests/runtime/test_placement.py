"""hvdtrain.runtime.placement: each rank's share of the CPU cores, from the ranks' bindings."""
import os
import threading

import pytest

from hvdtrain.runtime.placement import agreed_cpu_share, cpu_shares, expected_share, threads_started_on


def _flat(*bindings) -> dict:
    """A topology (see hvdtrain.runtime.placement.cpu_topology) in which every CPU of ``bindings`` is a physical core."""
    return {cpu: (0, cpu) for cpus in bindings for cpu in cpus}


def _shares(bindings, topology=None) -> tuple:
    bindings = [set(b) for b in bindings]
    return cpu_shares(bindings, topology or _flat(*bindings))


def _disjoint(shares) -> bool:
    return all(not set(x) & set(y) for i, x in enumerate(shares) for y in shares[i + 1:])


@pytest.mark.parametrize("bindings, shares", [
    ([range(8)] * 4, [(0, 1), (2, 3), (4, 5), (6, 7)]),                # nothing bound: one slice per rank
    ([range(2)] * 4, [(0, 1)] * 4),                                    # more ranks than CPUs: keep them all
    ([[0], [1]], [(0,), (1,)]),                                        # mpirun --bind-to core: keep the core
    ([range(4 * r, 4 * r + 4) for r in range(4)],                      # --map-by slot:PE=4
     [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15)]),
    ([range(8), range(8, 16)] * 2, [(0, 1, 2, 3), (8, 9, 10, 11), (4, 5, 6, 7), (12, 13, 14, 15)]),  # 2 per socket
    ([range(8), [8, 9]], [tuple(range(8)), (8, 9)]),                   # unequal bindings of their own: kept
])
def test_cpu_shares_of_bindings_that_are_the_same_or_disjoint(bindings, shares):
    assert _shares(bindings) == (tuple(shares), [])


@pytest.mark.parametrize("bindings", [
    [range(2), [1]],
    [range(8), range(8), range(4)],
    [range(4, 8), range(8)],
    [range(8), range(8, 16), range(16)],     # two ranks bound to a socket each, one unbound
    [range(16), range(8), range(8), [3]],
    [range(4), range(4), range(16)],         # ranks of one binding beside a wider one
    [[0, 1], [1, 2], [0, 2], range(4)],      # a disjoint assignment only by matching
])
def test_cpu_shares_of_overlapping_bindings_are_disjoint_parts_of_each(bindings):
    shares, overlapping = _shares(bindings)
    assert overlapping == list(range(len(bindings)))
    assert _disjoint(shares), shares
    for share, binding in zip(shares, bindings):
        assert share and set(share) <= set(binding), (share, binding)


@pytest.mark.parametrize("bindings, shares", [
    ([range(8), [0]], [tuple(range(1, 8)), (0,)]),              # no CPU left idle
    ([range(16), range(8)], [tuple(range(8, 16)), tuple(range(8))]),  # the wide rank leaves the narrow one its CPUs
])
def test_overlapping_bindings_leave_no_cpu_idle_and_narrow_ranks_their_cpus(bindings, shares):
    assert _shares(bindings) == (tuple(shares), [0, 1])


def test_a_binding_of_its_own_is_kept_beside_overlapping_ones():
    shares, overlapping = _shares([[0, 1], [1, 2], [4, 5], [0, 2], range(8, 40)])
    assert shares[2] == (4, 5) and shares[4] == tuple(range(8, 40)) and overlapping == [0, 1, 3], shares
    assert _disjoint(shares), shares


def test_cpu_shares_of_more_ranks_than_overlapping_cpus_share_the_least_used():
    shares, overlapping = _shares([{0, 1}, {0, 1}, {1}])
    assert overlapping == [0, 1, 2] and sorted(shares) == [(0,), (0,), (1,)] and shares[2] == (1,), shares


@pytest.mark.parametrize("cores, ranks, shares", [
    (4, 2, [(0, 1, 4, 5), (2, 3, 6, 7)]),                     # whole cores when they divide evenly
    (6, 4, [(0, 1, 6), (2, 7, 8), (3, 4, 9), (5, 10, 11)]),  # else CPUs in core order: edge cores split
])
def test_cpu_shares_keep_hyperthreads_of_a_core_together(cores, ranks, shares):
    """Linux numbering on a socket of ``cores`` cores with 2 hyperthreads each: CPUs 0..cores-1 are
    the first hyperthreads, cores..2*cores-1 their siblings."""
    topology = {cpu: (0, cpu % cores) for cpu in range(2 * cores)}
    assert _shares([range(2 * cores)] * ranks, topology) == (tuple(shares), [])


class _FakeAllgather:
    """The allgather :func:`agreed_cpu_share` is given, with its answer given: each rank's
    ``(machine, CPUs, thread-pool size, topology)``."""

    def __init__(self, everyone):
        self.everyone = everyone

    def __call__(self, obj):
        machine, cpus, pool, topology = obj  # what a rank sends: its machine, CPUs, pool size, topology
        assert machine and (cpus, pool) in [(e[1], e[2]) for e in self.everyone] and set(topology) == set(cpus), obj
        return self.everyone


def test_ranks_compare_bindings_by_machine_and_rank_0_warns_once(capsys):
    """Two machines: on ``a`` both ranks may run on the same 4 CPUs, on ``b`` they are bound to
    overlapping CPUs; rank 3's thread pool was sized for 2 CPUs and it gets 1. On ``c``, 3 ranks
    oversubscribe 2 CPUs: a thread each is right."""
    everyone = [("a", [0, 1, 2, 3], 2), ("b", [0, 1], 1), ("a", [0, 1, 2, 3], 2), ("b", [1], 2),
                ("c", [0, 1], 1), ("c", [0, 1], 1), ("c", [0, 1], 1)]
    everyone = [(m, cpus, pool, _flat(cpus)) for m, cpus, pool in everyone]
    fake = _FakeAllgather(everyone)
    got = [agreed_cpu_share(fake, 7, r, set(everyone[r][1]), everyone[r][2], False) for r in range(7)]
    assert got == [(0, 1), (0,), (2, 3), (1,), (0, 1), (0, 1), (0, 1)], got
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 2, said  # rank 0 alone, once each
    assert said[0].startswith("hvdtrain: warning: the launcher bound ranks 1, 3 to CPUs that overlap"), said
    assert said[1].startswith("hvdtrain: warning: rank 3 sized TensorFlow's thread pool"), said
    assert "(threads for CPUs: rank 3: 2 for 1)" in said[1], said
    agreed_cpu_share(fake, 7, 0, {0, 1, 2, 3}, 2, True)  # --threads given: no word on thread pools
    assert "thread pool" not in capsys.readouterr().err


def test_a_rank_alone_keeps_its_cpus_without_a_collective():
    def alone(obj):
        raise AssertionError("no collective at world size 1")
    assert agreed_cpu_share(alone, 1, 0, {2, 3}, 2, False) == (2, 3)


@pytest.mark.parametrize("own, launch, local_size, expected", [
    (range(8), range(8), 4, 2),       # unbound
    (range(2), range(8), 4, 2),       # bound to a quarter: its own
    (range(8), range(16), 4, 4),      # bound to a socket of two, shared by 2 of the 4 ranks
    (range(4), range(4), 2, 2),       # taskset around the launcher
    (range(2), range(2), 4, 1),       # oversubscribed
])
def test_expected_share_before_the_ranks_compare_bindings(own, launch, local_size, expected):
    assert expected_share(set(own), set(launch), local_size) == expected


def test_threads_started_in_the_block_run_on_its_cores_and_the_caller_is_restored():
    """As an elastic reset restarts Horovod: its new threads on the launch's cores, the caller
    (pinned to the rank's) back on its own after."""
    before = os.sched_getaffinity(0)
    target = {min(before)}
    seen = []
    with threads_started_on(target):
        thread = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        thread.start()
        thread.join()
    assert seen == [target] and os.sched_getaffinity(0) == before

