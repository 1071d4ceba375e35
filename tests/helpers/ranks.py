"""Start real ranks for tests: ``horovodrun --gloo``, ``horovodrun --mpi``, ``mpirun``, or one plain process."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
LAUNCHERS = ("gloo", "horovodrun-mpi", "mpirun", "single")

HOROVODRUN = [str(BIN / "horovodrun")]
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
          # Containers often forbid the cross-memory-attach that OpenMPI's shared-memory BTL tries first.
          "--mca", "btl_vader_single_copy_mechanism", "none"]


def rank_env(extra: Optional[dict] = None) -> dict:
    """The environment for ranks: this repository importable, no GPU, unbuffered output, root
    allowed, oneDNN's custom ops off; ``extra`` on top (a None value unsets its variable)."""
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "PATH": os.pathsep.join([str(BIN), env.get("PATH", "")]),
        "TF_CPP_MIN_LOG_LEVEL": "2",
        # Where TensorFlow turns oneDNN's custom ops on by default (CPUs with AVX-512 VNNI), every
        # process prints a line about it that TF_CPP_MIN_LOG_LEVEL cannot silence: the suite checks
        # stderr to the letter, and its exact comparisons assume one set of kernels.
        "TF_ENABLE_ONEDNN_OPTS": "0",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONUNBUFFERED": "1",
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
    })
    for key, value in (extra or {}).items():  # None: unset (TensorFlow's own default)
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def command(np_: int, argv: List[str], launcher: str = "gloo") -> List[str]:
    """The command line that starts ``np_`` ranks of ``python <argv>`` with ``launcher``."""
    return launch(np_, [sys.executable, *argv], launcher)


def launch(np_: int, program: List[str], launcher: str = "gloo") -> List[str]:
    """The command line that starts ``np_`` ranks of ``program`` (a whole argv) with ``launcher``."""
    if launcher == "gloo":
        return [*HOROVODRUN, "-np", str(np_), "-H", f"localhost:{np_}", "--gloo", *program]
    if launcher == "horovodrun-mpi":
        return [*HOROVODRUN, "-np", str(np_), "-H", f"localhost:{np_}", "--mpi",
                "--mpi-args=--oversubscribe --bind-to none", *program]
    if launcher == "mpirun":
        return [*MPIRUN, "-np", str(np_), *program]
    if launcher == "single":
        assert np_ == 1
        return program
    raise ValueError(f"unknown launcher {launcher!r}; one of {LAUNCHERS}")


def run_ranks(np_: int, argv: List[str], launcher: str = "gloo", timeout: float = 300,
              env: Optional[dict] = None, cwd=None, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``np_`` real ranks and wait; kill the whole process group on timeout.

    Raises:
        AssertionError: with the output, if ``check`` and the job exits non-zero or times out.
    """
    proc = subprocess.Popen(command(np_, argv, launcher), cwd=cwd or REPO, env=rank_env(env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s: {argv}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}")
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check and result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}: {' '.join(map(str, proc.args))}\n"
                             f"--- stdout\n{out[-4000:]}\n--- stderr\n{err[-6000:]}")
    return result


def processes_naming(marker: str) -> List[str]:
    """The command lines of this host's live processes whose arguments contain ``marker`` (a run's
    own directory, say): once the launcher has returned, every rank of that run should be gone."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
            with open(f"/proc/{pid}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:  # it ended while being read
            continue
        if not zombie and any(marker in a for a in args):
            found.append(" ".join(args).strip())
    return found
