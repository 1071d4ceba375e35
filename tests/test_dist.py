"""hvdtrain.dist with real ranks: every thread of a rank stays on the rank's own cores, and
Horovod's threads yield the CPU to the compute where that was measured to help (world size 1,
MPI) and keep their priority under Gloo."""
import functools
import json
import os
import subprocess
import sys

import pytest

from hvdtrain import dist
from hvdtrain.dist import _cpu_shares, _expected_share
from tests.ranks import MPIRUN, REPO, rank_env, run_ranks


def _parse_placements(stdout: str) -> list:
    """The placements tests/workers/thread_placement.py printed, one per rank, in rank order."""
    found = [json.loads(line.split("placement ", 1)[1]) for line in stdout.splitlines() if "placement " in line]
    return sorted(found, key=lambda r: r["rank"])


@functools.lru_cache(maxsize=None)
def _placements(np_: int, launcher: str) -> tuple:
    """Each rank's thread placement (see tests/workers/thread_placement.py), in rank order."""
    out = run_ranks(np_, ["-m", "tests.workers.thread_placement"], launcher=launcher, timeout=120).stdout
    ranks = _parse_placements(out)
    assert [r["rank"] for r in ranks] == list(range(np_)), out
    return tuple(ranks)


@pytest.mark.parametrize("np_, launcher, yields", [(1, "single", True), (2, "mpirun", True), (2, "gloo", False)])
def test_horovod_threads_yield_to_compute(np_, launcher, yields):
    for r in _placements(np_, launcher):
        assert r["nice0"] > 0, r  # TensorFlow's and Python's own threads keep their priority
        assert (r["nice19"] > 0) is yields, r
        assert r["horovod_nice"] == ([19] if yields else [0]), r
        if yields:  # ctx.horovod_threads names exactly the reniced threads
            assert r["horovod_threads"] == r["nice19"], r


@pytest.mark.parametrize("launcher", ["mpirun", "gloo"])
def test_every_thread_of_a_rank_stays_on_its_own_cores(launcher):
    """Horovod's and MPI's threads, started by hvd.init before the rank pins itself, are pinned too:
    none of them runs on another rank's cores."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores to give each of 2 ranks its own")
    ranks = _placements(2, launcher)
    for r in ranks:
        assert r["thread_cores"] == r["cores"], r
    assert not set(ranks[0]["cores"]) & set(ranks[1]["cores"]), ranks


def test_a_users_horovod_thread_affinity_is_left_alone():
    """With HOROVOD_THREAD_AFFINITY set, Horovod places its background thread itself (here each
    rank's on a core of the other rank); hvdtrain leaves that one where the user put it and pins
    every other thread, MPI's helpers (started before Horovod places its thread) included."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores to give each of 2 ranks its own")
    cores = sorted(os.sched_getaffinity(0))
    users_core = {0: cores[-1], 1: cores[0]}  # by local rank: in the other rank's share (shares are contiguous)
    out = run_ranks(2, ["-m", "tests.workers.thread_placement"], launcher="mpirun", timeout=120,
                    env={"HOROVOD_THREAD_AFFINITY": f"{cores[-1]},{cores[0]}"}).stdout
    ranks = _parse_placements(out)
    assert [r["rank"] for r in ranks] == [0, 1], out
    for r in ranks:
        assert users_core[r["rank"]] not in r["cores"], r
        assert r["thread_cores"] == sorted(set(r["cores"]) | {users_core[r["rank"]]}), r
        assert r["threads_elsewhere"] == 1, r  # Horovod's background thread alone; MPI's helpers are pinned


def _mpirun_with_its_own_binding(*binding) -> list:
    """MPIRUN without its ``--bind-to none`` and ``--oversubscribe``: OpenMPI's default binding, or
    the ``binding`` options given."""
    at = MPIRUN.index("--bind-to")
    return [a for a in MPIRUN[:at] + MPIRUN[at + 2:] if a != "--oversubscribe"] + list(binding)


def _placements_under(mpirun_options) -> tuple:
    """The ranks' placements (in rank order) and stderr of 2 ranks started by ``mpirun`` with
    ``mpirun_options``."""
    proc = subprocess.run([*mpirun_options, "-np", "2", sys.executable, "-m", "tests.workers.thread_placement"],
                          cwd=REPO, env=rank_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = _parse_placements(proc.stdout)
    assert [r["rank"] for r in ranks] == [0, 1], proc.stdout
    return ranks, proc.stderr


def _sockets(cores) -> set:
    """The physical packages (sockets) of ``cores``."""
    found = set()
    for core in cores:
        with open(f"/sys/devices/system/cpu/cpu{core}/topology/physical_package_id") as f:
            found.add(f.read().strip())
    return found


@pytest.mark.parametrize("binding", [(), ("--bind-to", "socket")], ids=["default, a core each", "one socket"])
def test_ranks_keep_cores_mpirun_bound_them_to_or_split_a_binding_they_share(binding):
    """OpenMPI's default binding for 2 ranks gives each a core of its own, which it keeps; with
    ``--bind-to socket`` on a one-socket host both are bound to every core, which they split.
    Either way each rank has cores of its own, every thread stays on them, and nothing is said."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs 2 cores for mpirun to bind each of 2 ranks to one without oversubscribing")
    if binding and len(_sockets(cores)) > 1:
        pytest.skip("mpirun would bind the ranks to different sockets")
    ranks, stderr = _placements_under(_mpirun_with_its_own_binding(*binding))
    assert "warning" not in stderr, stderr[-3000:]
    physical = [{dist._topology(cpu) for cpu in r["cores"]} for r in ranks]  # mpirun binds whole cores
    assert [len(p) for p in physical] == ([len({dist._topology(c) for c in cores}) // 2] * 2 if binding else [1, 1])
    assert not set(ranks[0]["cores"]) & set(ranks[1]["cores"]), ranks
    for r in ranks:
        assert r["thread_cores"] == r["cores"], r


def test_ranks_bound_to_overlapping_cores_get_cores_of_their_own_and_rank_0_says_so(tmp_path):
    """A rankfile binds rank 0 to two cores and rank 1 to the second: the bindings overlap without
    being the same, so rank 0 gets the first core, rank 1 the second, and rank 0 warns once."""
    cores = sorted(os.sched_getaffinity(0))
    if cores[:2] != [0, 1] or dist._topology(0) == dist._topology(1):
        pytest.skip("needs CPUs 0 and 1, two cores (a rankfile's slots number cores, not hyperthreads)")
    rankfile = tmp_path / "rankfile"
    rankfile.write_text(f"rank 0=localhost slot={cores[0]}-{cores[1]}\nrank 1=localhost slot={cores[1]}\n")
    ranks, stderr = _placements_under(_mpirun_with_its_own_binding("--rankfile", str(rankfile)))
    physical = [{dist._topology(cpu) for cpu in r["cores"]} for r in ranks]  # a core's hyperthreads, if any
    assert physical == [{dist._topology(0)}, {dist._topology(1)}], ranks
    said = "hvdtrain: warning: the launcher bound ranks 0, 1 to CPUs that overlap without being the same"
    assert stderr.count(said) == 1, stderr[-3000:]


def _flat(*bindings) -> dict:
    """A topology (see hvdtrain.dist._topology) in which every CPU of ``bindings`` is a physical core."""
    return {cpu: (0, cpu) for cpus in bindings for cpu in cpus}


def _shares(bindings, topology=None) -> tuple:
    bindings = [set(b) for b in bindings]
    return _cpu_shares(bindings, topology or _flat(*bindings))


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


class _FakeHorovod:
    """What :func:`hvdtrain.dist._agreed_cpu_share` uses of ``horovod.tensorflow``, with the
    allgather's answer given: each rank's ``(machine, CPUs, thread-pool size, topology)``."""

    def __init__(self, everyone):
        self.everyone = everyone

    def size(self):
        return len(self.everyone)

    def allgather_object(self, obj, name=None):
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
    fake = _FakeHorovod(everyone)
    got = [dist._agreed_cpu_share(fake, r, set(everyone[r][1]), everyone[r][2], False) for r in range(7)]
    assert got == [(0, 1), (0,), (2, 3), (1,), (0, 1), (0, 1), (0, 1)], got
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 2, said  # rank 0 alone, once each
    assert said[0].startswith("hvdtrain: warning: the launcher bound ranks 1, 3 to CPUs that overlap"), said
    assert said[1].startswith("hvdtrain: warning: rank 3 sized TensorFlow's thread pool"), said
    assert "(threads for CPUs: rank 3: 2 for 1)" in said[1], said
    dist._agreed_cpu_share(fake, 0, {0, 1, 2, 3}, 2, True)  # --threads given: no word on thread pools
    assert "thread pool" not in capsys.readouterr().err


def test_a_rank_alone_keeps_its_cpus_without_a_collective():
    class Alone(_FakeHorovod):
        def allgather_object(self, obj, name=None):
            raise AssertionError("no collective at world size 1")
    assert dist._agreed_cpu_share(Alone([None]), 0, {2, 3}, 2, False) == (2, 3)


@pytest.mark.parametrize("own, launch, local_size, expected", [
    (range(8), range(8), 4, 2),       # unbound
    (range(2), range(8), 4, 2),       # bound to a quarter: its own
    (range(8), range(16), 4, 4),      # bound to a socket of two, shared by 2 of the 4 ranks
    (range(4), range(4), 2, 2),       # taskset around the launcher
    (range(2), range(2), 4, 1),       # oversubscribed
])
def test_expected_share_before_the_ranks_compare_bindings(own, launch, local_size, expected):
    assert _expected_share(set(own), set(launch), local_size) == expected


def test_current_rank_is_the_launchers_until_horovod_runs_then_horovods():
    """Messages name the rank of now: after an elastic reset Horovod renumbers the workers, and the
    launcher's rank (here HOROVOD_RANK=5, which Horovod's MPI start-up ignores) is stale."""
    script = ("from hvdtrain.dist import current_rank\n"
              "before = current_rank()\n"
              "import horovod.tensorflow as hvd\n"
              "hvd.init()\n"
              "print('ranks', before, current_rank(), hvd.rank())\n")
    out = run_ranks(1, ["-c", script], launcher="single", timeout=120, env={"HOROVOD_RANK": "5"}).stdout
    assert "ranks 5 0 0" in out, out
