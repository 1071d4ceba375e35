"""--elastic under Horovod's elastic driver, with real workers: one is killed mid-epoch, one is added back.

Horovod starts one worker per slot that the host-discovery script lists and blacklists the host of
a worker that died, so the script lists local aliases of this machine (``localhost``,
``127.0.0.1``, and its own IPv4 address) as separate one-slot hosts: killing a worker removes
one alias, and appending another to the list adds a worker.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.ranks import BIN, REPO, rank_env
from tests.test_faults import rank_pid

EPOCHS = 8
NUM_TRAIN = 6000  # the synthetic dataset


def _third_local_alias():
    """An IPv4 address of this machine other than loopback (Horovod runs workers there without ssh)."""
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family.name == "AF_INET" and not a.address.startswith("127."):
                return a.address
    return None


def _epochs(log):
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def _wait_for(what, condition, job, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return
        if job.poll() is not None:
            raise AssertionError(f"job ended (exit {job.returncode}) before {what}:\n{job.communicate()[0][-4000:]}")
        time.sleep(0.3)
    os.killpg(job.pid, signal.SIGKILL)
    raise AssertionError(f"timed out waiting for {what}:\n{job.communicate()[0][-4000:]}")


def test_elastic_job_survives_a_killed_chief_and_uses_a_worker_added_back(tmp_path):
    third = _third_local_alias()
    if third is None:
        pytest.skip("this machine has no non-loopback IPv4 address to use as a third local host")
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")
    discover = tmp_path / "discover_hosts.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    log_dir = tmp_path / "run"
    log = log_dir / "metrics.jsonl"
    argv = [str(BIN / "horovodrun"), "-np", "2", "--min-np", "1", "--max-np", "2",
            "--host-discovery-script", str(discover),
            sys.executable, "-m", "hvdtrain", "--elastic", "--commit-every", "5", "--dataset", "synthetic",
            "--epochs", str(EPOCHS), "--batch-size", "32",
            "--threads", "1", "--no-progress", "--log-dir", str(log_dir)]
    job = subprocess.Popen(argv, cwd=REPO, env=rank_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)
    try:
        chief = rank_pid(job, 0)
        _wait_for("the first epoch", lambda: len(_epochs(log)) >= 1, job)
        time.sleep(1.0)  # mid-epoch
        os.kill(chief, signal.SIGKILL)  # rank 0 itself: another process must take over its duties
        _wait_for("an epoch at world size 1", lambda: any(e["world_size"] == 1 for e in _epochs(log)), job)
        with open(hosts, "a") as f:
            f.write(f"{third}:1\n")
        out, _ = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, out[-5000:]

    epochs = _epochs(log)
    assert [e["epoch"] for e in epochs] == list(range(1, EPOCHS + 1)), "each epoch logged once, in order"
    sizes = [e["world_size"] for e in epochs]
    assert sizes[0] == 2 and 1 in sizes, sizes
    assert 2 in sizes[sizes.index(1):], f"the worker added back trains: world sizes by epoch {sizes}"
    # Rolled back to the last commit and continued at the same example: every epoch, including
    # the interrupted one and those where the world size changed, trains on each example once.
    assert all(e["train_examples"] == NUM_TRAIN for e in epochs), [e["train_examples"] for e in epochs]
    assert epochs[-1]["train_accuracy"] > 0.7, epochs[-1]  # chance is 0.1
    assert "Killed" in out or "exit with status code 137" in out, out[-3000:]


def test_elastic_resume_continues_mid_epoch_at_another_world_size(tmp_path):
    """Kill the whole job after a mid-epoch checkpoint at world size 2; resume it on 1 worker."""
    hosts = tmp_path / "hosts"
    discover = tmp_path / "discover_hosts.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    log_dir = tmp_path / "run"

    def start(np_, *extra):
        hosts.write_text("localhost:1\n127.0.0.1:1\n" if np_ == 2 else "localhost:1\n")
        argv = [str(BIN / "horovodrun"), "-np", str(np_), "--min-np", str(np_), "--max-np", str(np_),
                "--host-discovery-script", str(discover), "--network-interfaces", "lo",
                sys.executable, "-m", "hvdtrain", "--elastic", "--dataset", "synthetic", "--model",
                "tests.models:cnn_sync_bn", "--epochs", "2", "--batch-size", "32", "--threads", "1",
                "--no-progress", "--log-dir", str(log_dir), *extra]
        return subprocess.Popen(argv, cwd=REPO, env=rank_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)

    def mid_epoch_checkpoint():
        for meta in (log_dir / "checkpoints").glob("ckpt-*/meta.json"):
            if json.loads(meta.read_text())["step_in_epoch"]:
                return True
        return False

    job = start(2, "--checkpoint-every", "30")
    try:
        _wait_for("a mid-epoch checkpoint", lambda: (log_dir / "checkpoints").exists() and mid_epoch_checkpoint(), job)
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate()
    assert not (log_dir / "metrics.jsonl").exists() or len(_epochs(log_dir / "metrics.jsonl")) < 2

    job = start(1, "--resume")
    out, _ = job.communicate(timeout=240)
    assert job.returncode == 0, out[-4000:]
    assert "resuming at step" in out, out[-3000:]
    epochs = _epochs(log_dir / "metrics.jsonl")
    assert [e["epoch"] for e in epochs] == [1, 2] and epochs[-1]["world_size"] == 1
    # The resumed epoch continued at the checkpoint's example: with the examples trained before
    # it (carried in the checkpoint's metric sums), each example once.
    assert all(e["train_examples"] == NUM_TRAIN for e in epochs), [e["train_examples"] for e in epochs]


def test_launch_script_runs_an_elastic_job_on_this_host(tmp_path):
    """launch/elastic.sh with its default discovery (this host, 2 slots) trains and exits 0."""
    env = rank_env({"VENV": str(BIN.parent), "LOG_DIR": str(tmp_path / "run"),
                    "ARGS": "--dataset synthetic --epochs 1 --threads 1 --no-progress"})
    proc = subprocess.run(["bash", str(REPO / "launch" / "elastic.sh")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    epochs = _epochs(tmp_path / "run" / "metrics.jsonl")
    assert [e["world_size"] for e in epochs] == [2] and epochs[0]["train_examples"] == NUM_TRAIN


def test_a_worker_that_fails_while_joining_is_left_out(tmp_path):
    """The survivors wait for a joining worker in the state sync; if it fails instead, they go on without it."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n")
    discover = tmp_path / "discover_hosts.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    marker = tmp_path / "joiners-fail"
    log = tmp_path / "run" / "metrics.jsonl"
    argv = [str(BIN / "horovodrun"), "-np", "1", "--min-np", "1", "--max-np", "2", "--host-discovery-script",
            str(discover), "--network-interfaces", "lo", sys.executable, "-m", "hvdtrain", "--elastic",
            "--commit-every", "5", "--dataset", "synthetic", "--model", "tests.models:fails_where_marker_exists",
            "--epochs", "6", "--batch-size", "32", "--threads", "1", "--no-progress", "--log-dir", str(tmp_path / "run")]
    job = subprocess.Popen(argv, cwd=REPO, env=rank_env({"HVDTRAIN_TEST_FAIL_MARKER": str(marker)}),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        _wait_for("the first epoch", lambda: len(_epochs(log)) >= 1, job)
        marker.touch()
        with open(hosts, "a") as f:
            f.write("127.0.0.1:1\n")
        out, _ = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, out[-5000:]
    assert "this worker's start-up fails (test)" in out, out[-3000:]
    epochs = _epochs(log)
    assert [e["epoch"] for e in epochs] == list(range(1, 7)) and {e["world_size"] for e in epochs} == {1}
    assert all(e["train_examples"] == NUM_TRAIN for e in epochs)


def test_an_error_in_rank_0s_writes_stops_every_worker_once(tmp_path):
    """A checkpoint that cannot be written ends the elastic job at once, with one message, instead
    of each new rank 0 meeting the same error after a reset."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")
    discover = tmp_path / "discover_hosts.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    run_dir = tmp_path / "run"
    argv = [str(BIN / "horovodrun"), "-np", "2", "--min-np", "1", "--max-np", "2", "--host-discovery-script",
            str(discover), sys.executable, "-m", "hvdtrain", "--elastic", "--dataset", "synthetic", "--model",
            "tests.models:cnn_sync_bn", "--epochs", "20", "--batch-size", "32", "--threads", "1", "--no-progress",
            "--log-dir", str(run_dir)]
    job = subprocess.Popen(argv, cwd=REPO, env=rank_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)
    try:
        _wait_for("the first checkpoint", lambda: any(run_dir.glob("checkpoints/ckpt-*/meta.json")), job)
        shutil.rmtree(run_dir / "checkpoints")
        (run_dir / "checkpoints").write_text("a file where the checkpoint directory was\n")
        blocked = time.time()
        out, _ = job.communicate(timeout=120)
        seconds = time.time() - blocked
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode != 0, out[-3000:]
    assert out.count("hvdtrain: error: cannot write checkpoint") == 1, out[-5000:]
    assert seconds < 60, f"took {seconds:.0f} s"
    assert len(_epochs(run_dir / "metrics.jsonl")) <= 2
