"""A real Slurm for tests: the one-node cluster of ``scripts/slurm-cluster.sh``, driven by sbatch,
scancel and scontrol (never a mock)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from typing import Dict, List, Optional

from tests.helpers.ranks import REPO, rank_env

SBATCH = REPO / "launch" / "slurm.sbatch"
VENV = os.path.dirname(os.path.dirname(sys.executable))
SUBMITTED: List[str] = []  # the job ids submit() made, for a test's teardown to cancel
DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
        "DEADLINE")


def slurm_unavailable() -> Optional[str]:
    """Why the Slurm tests cannot run here, or None: a cluster must answer with an idle node of
    2+ CPUs and requeue on hvdtrain's exit status 75 (``bash scripts/slurm-cluster.sh`` sets it up)."""
    if shutil.which("sbatch") is None:
        return "Slurm is not installed (bash scripts/slurm-cluster.sh installs and starts a one-node cluster)"
    try:
        nodes = subprocess.run(["sinfo", "-h", "-o", "%T %c"], capture_output=True, text=True, timeout=20)
        config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"no Slurm controller answers ({e}); start one with bash scripts/slurm-cluster.sh"
    states = [line.split() for line in nodes.stdout.splitlines() if line.strip()]
    if nodes.returncode or not any(s[0] in ("idle", "mixed") and int(s[1]) >= 2 for s in states):
        return (f"no idle Slurm node with 2 CPUs (sinfo: {(nodes.stdout + nodes.stderr).strip()[:200]!r}); "
                f"start the cluster with bash scripts/slurm-cluster.sh")
    if not any(line.split("=")[-1].strip() == "75" for line in config.stdout.splitlines()
               if line.startswith("RequeueExit ")):
        return "this Slurm does not requeue on exit status 75 (slurm.conf RequeueExit=75; scripts/slurm-cluster.sh)"
    return None


def submit(args: List[str], launcher: str, output, extra_env: Optional[dict] = None, sbatch_args=()) -> str:
    """``sbatch launch/slurm.sbatch`` at 2 tasks on 1 node, 1 CPU each, no GPU, with hvdtrain's
    ``args`` (the script's ARGS) and ``launcher`` (srun or mpirun); returns the job id (also kept
    in :data:`SUBMITTED`)."""
    env = rank_env({"VENV": VENV, "ARGS": " ".join(map(str, args)), "LAUNCHER": launcher, **(extra_env or {})})
    result = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1",
                             "--gpus-per-node=0", "--time=10", f"--chdir={REPO}", f"--output={output}",
                             *sbatch_args, str(SBATCH)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    SUBMITTED.append(result.stdout.strip().split(";")[0])
    return SUBMITTED[-1]


def job(job_id: str) -> Dict[str, str]:
    """``scontrol show job``'s fields (JobState, Restarts, ExitCode, ...)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30).stdout
    return dict(field.split("=", 1) for field in out.split() if "=" in field)


def wait_for(job_id: str, timeout: float = 300) -> Dict[str, str]:
    """The job's fields once it has ended for good (a requeued job runs again first).

    Slurm holds a requeued job for two minutes (its BeginTime); this starts it at once instead.

    Raises:
        AssertionError: if it still runs after ``timeout`` seconds (then it is cancelled).
    """
    deadline = time.time() + timeout
    while time.time() < deadline:
        fields = job(job_id)
        if fields.get("JobState") in DONE:
            return fields
        if fields.get("JobState") == "PENDING" and fields.get("Reason") == "BeginTime":
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], capture_output=True, timeout=30)
        time.sleep(0.5)
    subprocess.run(["scancel", job_id])
    raise AssertionError(f"job {job_id} still running after {timeout:.0f} s: {job(job_id)}")


def rank_pids(marker: str) -> Dict[int, int]:
    """``{rank: pid}`` of the hvdtrain ranks whose command line holds ``marker`` (their --log-dir)."""
    ranks = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except OSError:
            continue
        if b"hvdtrain" not in argv or marker.encode() not in argv or not argv[0].endswith(b"python"):
            continue
        rank = env.get(b"OMPI_COMM_WORLD_RANK", env.get(b"PMIX_RANK", env.get(b"SLURM_PROCID")))
        if rank is not None:
            ranks[int(rank)] = int(pid)
    return ranks
