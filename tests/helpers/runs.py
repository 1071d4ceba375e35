"""Whole runs with real ranks: the command line, the oracle's training steps, and their outputs."""
import json
import os
import subprocess
import time

import numpy as np

from tests.helpers.ranks import run_ranks


def hvdtrain(np_, args, launcher="gloo", timeout=300, check=True):
    return run_ranks(np_, ["-m", "hvdtrain", *args], launcher=launcher, timeout=timeout, check=check)


def metrics(run_dir):
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def weights(path_prefix, rank=0):
    data = np.load(f"{path_prefix}.rank{rank}.npz")
    return {k: data[k] for k in data.files}


def train_steps(tmp_path, tag, np_, model, sizes, steps, *extra, launcher="gloo", env=None):
    out = tmp_path / f"{tag}.npz"
    run_ranks(np_, ["-m", "tests.workers.train_steps", str(out), model, sizes, str(steps), *extra],
              launcher=launcher, timeout=240, env=env)
    return str(out)[:-4]


def _parent(pid: str) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def descends_from(pid: str, ancestor: int) -> bool:
    try:
        while int(pid) > 1:
            if int(pid) == ancestor:
                return True
            pid = str(_parent(pid))
    except (OSError, ValueError):
        pass
    return False


def rank_pid(job: subprocess.Popen, rank: int) -> int:
    """The pid of the process this job's launcher started as ``rank`` (found through its environment)."""
    for _ in range(600):
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or not descends_from(pid, job.pid):
                continue
            try:
                environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:
                continue
            if b"hvdtrain" in cmdline and (f"HOROVOD_RANK={rank}".encode() in environ
                                           or f"OMPI_COMM_WORLD_RANK={rank}".encode() in environ):
                return int(pid)
        time.sleep(0.1)
    raise AssertionError("rank process not found")
