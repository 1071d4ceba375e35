"""launch/slurm.sbatch on a real one-node Slurm (scripts/slurm-cluster.sh): it trains at 2 tasks
through srun and through mpirun as horovodrun does, to every digit; a rank killed with -9 ends the
job in seconds with one line naming it; SIGTERM and the batch script's SIGUSR1 (what
``--signal=B:USR1@120`` sends before the time limit) stop every rank after the same step with a
checkpoint, and the job that Slurm requeues on exit status 75 ends as the uninterrupted run does."""
import json
import os
import re
import signal
import subprocess
import time

import pytest

from tests.helpers.ranks import run_ranks
from tests.helpers.slurm import SUBMITTED, job, rank_pids, slurm_unavailable, submit, wait_for

REASON = slurm_unavailable()
pytestmark = pytest.mark.skipif(bool(REASON), reason=str(REASON))

# What a run computes (not how fast): equal to the last bit under every launcher.
RESULT_KEYS = ("epoch", "train_loss", "train_accuracy", "test_loss", "test_accuracy", "train_examples", "lr",
               "world_size")
LONG = ["--dataset", "synthetic", "--model", "tests.helpers.models:mlp", "--epochs", "100000", "--batch-size", "32",
        "--no-progress", "--threads", "1"]


@pytest.fixture(autouse=True)
def cancel_left_jobs():
    """A test that fails leaves no job behind to hold the one node from the next tests."""
    yield
    while SUBMITTED:
        subprocess.run(["scancel", SUBMITTED.pop()], capture_output=True, timeout=60)


def results(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [{k: m[k] for k in RESULT_KEYS} for m in map(json.loads, f)]


def printed_results(out):
    """The epoch lines' figures but the speed and time: ``epoch 1/1 train loss 0.4111 acc ...``."""
    lines = re.findall(r"^(?:\[\d+\]<stdout>:)?(epoch .*)$", out, re.MULTILINE)  # horovodrun prefixes the rank
    return [re.sub(r"\s+[\d,]+ img/s\s+[\d.]+ s", "", line) for line in lines]


def text(path):
    """The file's text, or "" before the job has created it (while it waits in the queue)."""
    return path.read_text() if path.exists() else ""


@pytest.fixture(scope="module")
def three_epochs(tmp_path_factory, fashion_slice_job):
    """Three epochs of the Fashion-MNIST slice under horovodrun (Gloo) at np=2: (flags, run dir, stdout)."""
    flags = [*fashion_slice_job, "--epochs", "3"]
    run_dir = tmp_path_factory.mktemp("slurm_reference") / "run"
    done = run_ranks(2, ["-m", "hvdtrain", *flags, "--log-dir", str(run_dir)], timeout=600)
    return flags, run_dir, done.stdout


@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_sbatch_trains_as_horovodrun_does(tmp_path, launcher, fashion_slice_job, fashion_slice_gloo_metrics):
    job_id = submit([*fashion_slice_job, "--log-dir", tmp_path / "run"], launcher, tmp_path / "job.out")
    fields = wait_for(job_id, timeout=600)
    out = (tmp_path / "job.out").read_text()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", out[-3000:]
    assert "world size 2 (2 local rank(s) x 1 host(s))" in out, out[-3000:]
    (last,) = results(tmp_path / "run")
    assert last == {k: fashion_slice_gloo_metrics[k] for k in RESULT_KEYS}


@pytest.mark.parametrize("launcher, rank", [("srun", 0), ("srun", 1), ("mpirun", 1)])
def test_a_killed_rank_ends_the_job_in_seconds(tmp_path, launcher, rank):
    """``kill -9`` of one rank mid-training: every rank gone in under 5 s, whatever KillWait (30 s
    here) is, one line naming the lost rank, and no requeue (it is no stop on purpose)."""
    run_dir = str(tmp_path / "run")
    job_id = submit([*LONG, "--log-dir", run_dir], launcher, tmp_path / "job.out")
    deadline = time.time() + 600  # its wait in the queue too: the other tests' jobs take the node
    while not list((tmp_path / "run" / "checkpoints").glob("ckpt-*")) and time.time() < deadline:
        time.sleep(0.2)  # an epoch checkpointed: training is under way
    ranks = rank_pids(run_dir)
    assert sorted(ranks) == [0, 1], (ranks, job(job_id))
    os.kill(ranks[rank], signal.SIGKILL)
    killed = time.time()
    while rank_pids(run_dir) and time.time() - killed < 60:
        time.sleep(0.05)
    gone = time.time() - killed
    fields = wait_for(job_id, timeout=60)
    out = (tmp_path / "job.out").read_text()
    assert gone < 5, f"ranks still there {gone:.1f} s after the kill\n{out[-3000:]}"
    named = re.findall(rf"hvdtrain: error: rank {rank} was lost mid-training[^\n]*--resume --log-dir {run_dir}", out)
    if launcher == "srun":
        assert len(named) == 1, out[-3000:]
    else:  # mpirun names it too, and may end rank 0 before its watchdog does
        assert len(named) <= 1 and (named or f"process rank {rank} " in out), out[-3000:]
    assert "hvdtrain: error" not in out.replace(named[0] if named else "\0", ""), out[-3000:]
    assert fields["JobState"] == "FAILED" and fields["Restarts"] == "0", fields


@pytest.mark.parametrize("launcher, scancel", [
    ("srun", ["--signal=TERM"]),  # scancel's SIGTERM to every task, as at preemption
    ("srun", ["--batch", "--signal=USR1"]),  # what --signal=B:USR1@120 sends before the time limit
    ("mpirun", ["--batch", "--signal=USR1"]),
])
def test_a_signal_stops_every_rank_at_one_step_and_the_requeued_job_ends_as_the_whole_run(
        tmp_path, launcher, scancel, three_epochs):
    flags, reference, reference_out = three_epochs
    run_dir = str(tmp_path / "run")
    job_id = submit([*flags, "--log-dir", run_dir], launcher, tmp_path / "job.out")
    deadline = time.time() + 600  # its wait in the queue too
    while "epoch   1/3" not in text(tmp_path / "job.out") and time.time() < deadline:
        time.sleep(0.1)
    subprocess.run(["scancel", *scancel, job_id], check=True)
    fields = wait_for(job_id)
    out = (tmp_path / "job.out").read_text()
    name = "SIGTERM" if "TERM" in scancel[-1] else "SIGUSR1"
    stops = re.findall(rf"hvdtrain: stopped by {name} after epoch (\d), (?:step (\d+) of \d+, )?every rank there, "
                       rf"and checkpointed it: rerun the same command with --resume --log-dir {run_dir} ", out)
    assert len(stops) == 1, out[-4000:]
    assert fields["Restarts"] == "1" and fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", fields
    epoch, step = int(stops[0][0]), int(stops[0][1] or 0)
    again = out.split("hvdtrain: stopped by")[1]  # the requeued run's part of the output
    resumed = f"resuming at step {step + 1} of epoch {epoch}" if step else f"epochs {epoch + 1}..3"
    assert out.count("run:   ") == 2 and resumed in again, out[-4000:]
    assert results(run_dir)[-1] == results(reference)[-1]
    assert printed_results(out)[-1] == printed_results(reference_out)[-1]


def test_a_job_requeued_before_its_checkpoint_directory_starts_over(tmp_path, fashion_slice_job,
                                                                    fashion_slice_gloo_metrics):
    """Preempted (``scontrol requeue``) before its first run made the checkpoint directory: the
    requeued job adds no --resume, which would refuse a directory that is not there, and trains
    from the beginning to the uninterrupted run's result."""
    run_dir = tmp_path / "run"
    job_id = submit([*fashion_slice_job, "--log-dir", run_dir], "srun", tmp_path / "job.out")
    deadline = time.time() + 600  # its wait in the queue too
    while job(job_id).get("JobState") != "RUNNING" and time.time() < deadline:
        time.sleep(0.05)
    subprocess.run(["scontrol", "requeue", job_id], check=True)
    made = (run_dir / "checkpoints").exists()  # almost never: the first run is still starting
    fields = wait_for(job_id, timeout=600)
    out = (tmp_path / "job.out").read_text()
    assert fields["Restarts"] == "1" and fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", out[-3000:]
    assert made or "--resume" not in out, out[-3000:]
    (last,) = results(run_dir)
    assert last == {k: fashion_slice_gloo_metrics[k] for k in RESULT_KEYS}
