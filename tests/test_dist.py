"""hvdtrain.dist with real ranks: every thread of a rank stays on the rank's own cores, and
Horovod's threads yield the CPU to the compute where that was measured to help (world size 1,
MPI) and keep their priority under Gloo."""
import functools
import json
import os
import subprocess
import sys

import pytest

from hvdtrain.dist import (_cpu_share, _host_cores, _launcher_binding, _launcher_binding_warning,
                           _parse_cpu_list)
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


def test_a_rank_mpirun_bound_to_a_core_of_its_own_keeps_it_and_nothing_is_said():
    """OpenMPI's default binding for 2 ranks (each to one core) gives every rank cores of its own:
    hvdtrain keeps them and has nothing to warn about."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores for mpirun to bind each of 2 ranks to one without oversubscribing")
    proc = subprocess.run([*_mpirun_with_its_own_binding(), "-np", "2", sys.executable, "-m",
                           "tests.workers.thread_placement"], cwd=REPO, env=rank_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warning" not in proc.stderr, proc.stderr[-3000:]
    ranks = _parse_placements(proc.stdout)
    assert [len(r["cores"]) for r in ranks] == [1, 1], ranks
    assert not set(ranks[0]["cores"]) & set(ranks[1]["cores"]), ranks
    for r in ranks:
        assert r["thread_cores"] == r["cores"], r


def _sockets(cores) -> set:
    """The physical packages (sockets) of ``cores``."""
    found = set()
    for core in cores:
        with open(f"/sys/devices/system/cpu/cpu{core}/topology/physical_package_id") as f:
            found.add(f.read().strip())
    return found


def test_ranks_mpirun_bound_to_one_shared_socket_are_split_and_rank_0_says_so():
    """``--bind-to socket`` binds both ranks to the same cores (this host's one socket): they are
    split between the ranks, and rank 0 says once, on stderr, how to start mpirun instead."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs 2 cores to give each of 2 ranks its own")
    if len(_sockets(cores)) > 1:
        pytest.skip("mpirun would bind the ranks to different sockets")
    proc = subprocess.run([*_mpirun_with_its_own_binding("--bind-to", "socket"), "-np", "2", sys.executable,
                           "-m", "tests.workers.thread_placement"], cwd=REPO, env=rank_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = _parse_placements(proc.stdout)
    assert not set(ranks[0]["cores"]) & set(ranks[1]["cores"]), ranks
    said = "hvdtrain: warning: mpirun bound this rank to"
    assert proc.stderr.count(said) == 1, proc.stderr[-3000:]
    assert "start mpirun with -bind-to none -map-by slot" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("local_rank, local_size, own, host, bound, share", [
    (1, 4, range(8), range(8), False, (2, 3)),             # nothing bound: one slice per rank
    (1, 2, range(4), range(16), False, (2, 3)),            # taskset -c 0-3 around the launcher: split
    (3, 4, range(2), range(8), False, (0, 1)),             # fewer cores than ranks: keep them
    (1, 2, [1], range(2), True, (1,)),                     # mpirun --bind-to core: keep the core
    (2, 4, range(8, 12), range(16), True, (8, 9, 10, 11)),  # --map-by slot:PE=4 / srun --cpu-bind=cores
    (2, 4, range(8), range(16), True, (4, 5)),             # one socket, shared by 2 of the 4 ranks: split
    (1, 2, range(2), range(2), True, (1,)),                # --bind-to socket on a one-socket host
])
def test_cpu_share(local_rank, local_size, own, host, bound, share):
    assert _cpu_share(local_rank, local_size, set(own), frozenset(host), bound) == share


def test_launcher_binding_warning_only_for_a_binding_cut_down():
    assert _launcher_binding_warning(None, {0, 1}, (1,)) is None
    assert _launcher_binding_warning("mpirun", {3}, (3,)) is None
    said = _launcher_binding_warning("srun", set(range(8)), (4, 5))
    assert said.startswith("hvdtrain: warning: srun bound this rank to 8 core(s) that other ranks on its host "
                           "may share, and it keeps 2"), said
    assert said.endswith("start srun with --cpu-bind=none"), said


@pytest.mark.parametrize("env, launcher", [
    ({}, None),
    ({"OMPI_MCA_orte_bound_at_launch": "1"}, "mpirun"),
    ({"SLURM_CPU_BIND_TYPE": "mask_cpu:"}, "srun"),
    ({"SLURM_CPU_BIND_TYPE": "quiet,none"}, None),
    ({"SLURM_CPU_BIND_TYPE": "none"}, None),
])
def test_launcher_binding_from_the_launchers_environment(monkeypatch, env, launcher):
    for name in ("OMPI_MCA_orte_bound_at_launch", "SLURM_CPU_BIND_TYPE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert _launcher_binding() == launcher


def test_parse_cpu_list_and_host_cores():
    assert _parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert set(os.sched_getaffinity(0)) <= _host_cores()  # this process runs within its cgroup's cpuset


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
