"""hvdtrain.runtime.dist with real ranks: every thread of a rank stays on the rank's own cores
(Horovod's under MPI too; under Gloo they keep the launch's), and Horovod's threads yield the CPU
to the compute where that was measured to help (world size 1, MPI) and keep their priority under
Gloo."""
import functools
import json
import os
import subprocess
import sys

import pytest

from hvdtrain.runtime.placement import cpu_topology
from tests.helpers.ranks import MPIRUN, REPO, rank_env, run_ranks


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


def test_every_thread_of_a_rank_stays_on_its_own_cores_under_mpi():
    """Horovod's and MPI's threads, started by hvd.init before the rank pins itself, are pinned too:
    none of them busy-polls on another rank's cores."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores to give each of 2 ranks its own")
    ranks = _placements(2, "mpirun")
    for r in ranks:
        assert r["thread_cores"] == r["cores"], r
    assert not set(ranks[0]["cores"]) & set(ranks[1]["cores"]), ranks


def test_under_gloo_only_horovods_threads_keep_the_launch_cores():
    """Under Gloo every thread but Horovod's (which sleep between messages) stays on the rank's
    cores; Horovod's keep the cores the rank was launched on, here all of this machine's."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores to give each of 2 ranks its own")
    ranks = _placements(2, "gloo")
    for r in ranks:
        assert r["other_cores"] == r["cores"], r
        assert r["horovod_threads"] > 0 and r["horovod_cores"] == sorted(os.sched_getaffinity(0)), r
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
    physical = [{cpu_topology(cpu) for cpu in r["cores"]} for r in ranks]  # mpirun binds whole cores
    assert [len(p) for p in physical] == ([len({cpu_topology(c) for c in cores}) // 2] * 2 if binding else [1, 1])
    assert not set(ranks[0]["cores"]) & set(ranks[1]["cores"]), ranks
    for r in ranks:
        assert r["thread_cores"] == r["cores"], r


def test_ranks_bound_to_overlapping_cores_get_cores_of_their_own_and_rank_0_says_so(tmp_path):
    """A rankfile binds rank 0 to two cores and rank 1 to the second: the bindings overlap without
    being the same, so rank 0 gets the first core, rank 1 the second, and rank 0 warns once."""
    cores = sorted(os.sched_getaffinity(0))
    if cores[:2] != [0, 1] or cpu_topology(0) == cpu_topology(1):
        pytest.skip("needs CPUs 0 and 1, two cores (a rankfile's slots number cores, not hyperthreads)")
    rankfile = tmp_path / "rankfile"
    rankfile.write_text(f"rank 0=localhost slot={cores[0]}-{cores[1]}\nrank 1=localhost slot={cores[1]}\n")
    ranks, stderr = _placements_under(_mpirun_with_its_own_binding("--rankfile", str(rankfile)))
    physical = [{cpu_topology(cpu) for cpu in r["cores"]} for r in ranks]  # a core's hyperthreads, if any
    assert physical == [{cpu_topology(0)}, {cpu_topology(1)}], ranks
    said = "hvdtrain: warning: the launcher bound ranks 0, 1 to CPUs that overlap without being the same"
    assert stderr.count(said) == 1, stderr[-3000:]


def test_current_rank_is_the_launchers_until_horovod_runs_then_horovods():
    """Messages name the rank of now: after an elastic reset Horovod renumbers the workers, and the
    launcher's rank (here HOROVOD_RANK=5, which Horovod's MPI start-up ignores) is stale."""
    script = ("from hvdtrain.runtime.dist import current_rank\n"
              "before = current_rank()\n"
              "import horovod.tensorflow as hvd\n"
              "hvd.init()\n"
              "print('ranks', before, current_rank(), hvd.rank())\n")
    out = run_ranks(1, ["-c", script], launcher="single", timeout=120, env={"HOROVOD_RANK": "5"}).stdout
    assert "ranks 5 0 0" in out, out
