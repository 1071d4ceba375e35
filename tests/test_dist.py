"""hvdtrain.dist with real ranks: every thread of a rank stays on the rank's own cores, and
Horovod's threads yield the CPU to the compute where that was measured to help (world size 1,
MPI) and keep their priority under Gloo."""
import functools
import json
import os
import subprocess
import sys

import pytest

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


def test_a_rank_mpirun_bound_at_launch_says_how_to_start_it():
    """mpirun's default binding (each of 2 ranks to one core) is kept, and rank 0 says once, on
    stderr, to start mpirun with -bind-to none (with it, tests/test_cli.py's mpirun run says nothing)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores for mpirun to bind each of 2 ranks to one without oversubscribing")
    binding = MPIRUN.index("--bind-to")
    mpirun = [a for a in MPIRUN[:binding] + MPIRUN[binding + 2:] if a != "--oversubscribe"]  # OpenMPI's defaults
    proc = subprocess.run([*mpirun, "-np", "2", sys.executable, "-m", "tests.workers.thread_placement"], cwd=REPO,
                          env=rank_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = "hvdtrain: warning: mpirun bound this rank to 1 core(s), and it keeps 1; hvdtrain gives each rank its " \
           "own share of the host's cores itself: start mpirun with -bind-to none -map-by slot (horovodrun does)"
    assert proc.stderr.count(said) == 1, proc.stderr[-3000:]
    ranks = _parse_placements(proc.stdout)
    assert [len(r["cores"]) for r in ranks] == [1, 1], ranks


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
