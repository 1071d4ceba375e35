"""Faults with real ranks: a frozen rank and a killed rank end the whole job promptly, never a hang."""
import os
import re
import signal
import subprocess
import time

import pytest

from tests.helpers.ranks import command, rank_env, run_ranks
from tests.helpers.runs import rank_pid

ARGS = ["-m", "hvdtrain", "--dataset", "synthetic", "--model", "tests.helpers.models:mlp", "--epochs", "100000",
        "--batch-size", "32", "--no-progress", "--threads", "1", "--log-every", "5"]


def start_then(signal_number, launcher, tmp_path, extra=()):
    """Start 2 ranks, wait until training runs, send ``signal_number`` to rank 1; return (rc, seconds, output)."""
    checkpoints = tmp_path / "checkpoints"
    job = subprocess.Popen(command(2, [*ARGS, "--log-dir", str(tmp_path), *extra], launcher), env=rank_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    victim = rank_pid(job, 1)
    deadline = time.time() + 180
    while not list(checkpoints.glob("ckpt-*")) and time.time() < deadline:  # an epoch checkpointed: training is under way
        time.sleep(0.5)
    assert list(checkpoints.glob("ckpt-*")), "training did not start"
    os.kill(victim, signal_number)
    start = time.time()
    try:
        out, _ = job.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        out, _ = job.communicate()
        raise AssertionError(f"job still running 90 s after the fault\n{out[-3000:]}")
    finally:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return job.returncode, time.time() - start, out


@pytest.mark.parametrize("launcher", ["gloo", "mpirun"])
def test_frozen_rank_aborts_the_job(tmp_path, launcher):
    rc, seconds, out = start_then(signal.SIGSTOP, launcher, tmp_path, ["--stall-timeout", "10"])
    assert rc != 0
    assert seconds < 40, f"took {seconds:.0f} s"
    # Where rank 0 waits depends on when the signal lands: a step's allreduces, the metrics, evaluation.
    assert re.search(r"hvdtrain: error: rank 0 made no progress for 1\d s after [^\n]+, waiting in [^\n]+\. "
                     r"Stalled: rank 1 sent no heartbeat for \d+ s \(frozen", out), out[-3000:]
    assert out.count("made no progress") == 1, out[-3000:]  # printed once, by rank 0


def test_rank_stuck_outside_a_collective_is_named(tmp_path):
    """Rank 1 never finishes building its model (as if stuck reading data): rank 0 names it."""
    args = ["-m", "hvdtrain", "--dataset", "synthetic", "--model", "tests.helpers.models:hangs_on_rank_1",
            "--stall-timeout", "10", "--log-dir", str(tmp_path), "--threads", "1"]
    start = time.time()
    proc = subprocess.run(command(2, args, "gloo"), env=rank_env(), capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and time.time() - start < 60, out[-3000:]
    assert re.search(r"Stalled: rank 1 is stuck outside any collective after building the model", out), out[-3000:]
    assert out.count("made no progress") == 1, out[-3000:]


def test_error_on_one_rank_mid_training_is_printed_once(tmp_path):
    args = ["-m", "hvdtrain", "--dataset", "synthetic", "--model", "tests.helpers.models:fails_on_rank_1_mid_training",
            "--epochs", "3", "--batch-size", "32", "--no-progress", "--threads", "1", "--log-dir", str(tmp_path)]
    start = time.time()
    proc = subprocess.run(command(2, args, "gloo"), env=rank_env(), capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and time.time() - start < 60, out[-3000:]
    assert out.count("corrupt record in the shard of rank 1") >= 1, out[-3000:]
    assert re.findall(r"\[(\d+)\]<stderr>:Traceback", out) == ["1"], out[-5000:]  # rank 1's own, once
    assert not re.search(r"\[0\]<stderr>:.*hvdtrain: error", out), out[-3000:]  # rank 0 stays quiet
    assert "hvdtrain: stopped by SIGTERM" not in out, out[-3000:]  # though horovodrun sends it SIGTERM


def test_killed_rank_ends_the_job_with_one_clear_message(tmp_path):
    """Rank 1 killed mid-training: rank 0 names it, though horovodrun sends it SIGTERM as it would
    for Ctrl-C (rank 0 tells a lost peer from one that was stopped by their heartbeats)."""
    rc, seconds, out = start_then(signal.SIGKILL, "gloo", tmp_path)
    assert rc != 0 and seconds < 30, f"rc {rc} after {seconds:.0f} s"
    assert out.count("hvdtrain: error: rank 1 was lost mid-training") == 1, out[-3000:]
    assert f"--resume --log-dir {tmp_path} to continue from its last checkpoint" in out, out[-3000:]
    assert "hvdtrain: stopped by SIGTERM" not in out, out[-3000:]
    assert not re.search(r"\[\d+\]<stderr>:Traceback", out), "a rank printed a traceback"


def test_a_rank_lost_before_any_checkpoint_is_not_told_to_resume(tmp_path):
    result = run_ranks(2, [*ARGS[:5], "tests.helpers.models:killed_on_rank_1_in_epoch_1", *ARGS[6:], "--log-dir",
                           str(tmp_path)], check=False, timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode != 0 and "rank 1 was lost mid-training" in out, out[-3000:]
    assert "No checkpoint was written yet: rerun the same command to start again" in out, out[-3000:]
    assert "--resume" not in out, out[-3000:]


def test_killed_rank_under_mpirun_ends_the_job(tmp_path):
    """Under mpirun rank 0 waits in a shared-memory collective that never returns, so mpirun ends
    it and names the dead rank; hvdtrain adds nothing misleading, and nothing hangs."""
    rc, seconds, out = start_then(signal.SIGKILL, "mpirun", tmp_path)
    assert rc != 0 and seconds < 30, f"rc {rc} after {seconds:.0f} s"
    assert re.search(r"process rank 1 .* exited on signal 9", out), out[-3000:]
    assert "hvdtrain: stopped by SIGTERM" not in out and "Traceback" not in out, out[-3000:]


def test_a_rank_wedged_while_pinning_ends_the_job(tmp_path):
    """Rank 1 never returns from its device query after hvd.init: the watchdogs, armed once every
    rank has started Horovod, end the job after --stall-timeout instead of leaving rank 0 waiting
    in the pinning collective for ever."""
    result = run_ranks(2, ["-m", "tests.workers.wedged_while_pinning", "--dataset", "synthetic", "--model",
                           "tests.helpers.models:mlp", "--stall-timeout", "5", "--log-dir", str(tmp_path / "run")],
                       timeout=120, check=False)
    assert result.returncode != 0
    assert "made no progress for" in result.stderr and "after pinning devices" in result.stderr, result.stderr[-3000:]
