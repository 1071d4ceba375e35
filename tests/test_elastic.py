"""--elastic under Horovod's elastic driver, with real workers: one is killed mid-epoch, one is added back.

Horovod starts one worker per slot that the host-discovery script lists and blacklists the host of
a worker that died, so the script lists local aliases of this machine (``localhost``,
``127.0.0.1``, and its own IPv4 address) as separate one-slot hosts: killing a worker removes
one alias, and appending another to the list adds a worker.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest

from hvdtrain.data.in_memory import make_synthetic
from hvdtrain.tools.make_image_folder import write_image_folder
from tests.helpers.ranks import BIN, HOROVODRUN, REPO, rank_env
from tests.helpers.runs import rank_pid
# epoch at world size 1 is logged; it joins within an epoch here (about 8 s), and the four epochs
# after the kill leave room for a slower start-up. Train accuracy passes 0.9 by epoch 5.
EPOCHS = 6
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


def _elastic_job(tmp_path, hosts, np_, max_np, args, env=None, module="hvdtrain", log_dir="run"):
    """Start ``horovodrun --min-np 1`` with a discovery script that prints the file ``tmp_path/hosts``
    (first written with ``hosts``; append to it to add workers) and ``hvdtrain --elastic``, with
    ``--log-dir tmp_path/log_dir`` (with ``log_dir=None``, none, and ``tmp_path`` as working directory).

    Returns ``(job, hosts_file)``; the job's output is on ``job.stdout`` (stderr merged).
    """
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text("".join(f"{h}:1\n" for h in hosts))
    discover = tmp_path / "discover_hosts.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts_file}\n")
    discover.chmod(0o755)
    # Horovod's elastic driver starts on a single host only when told the interface.
    single_host = ["--network-interfaces", "lo"] if len(hosts) == 1 else []
    argv = [*HOROVODRUN, "-np", str(np_), "--min-np", "1", "--max-np", str(max_np),
            "--host-discovery-script", str(discover), *single_host,
            sys.executable, "-m", module, "--elastic", "--dataset", "synthetic", "--batch-size", "32",
            "--threads", "1", "--no-progress", *(["--log-dir", str(tmp_path / log_dir)] if log_dir else []), *args]
    job = subprocess.Popen(argv, cwd=REPO if log_dir else tmp_path, env=rank_env(env), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return job, hosts_file


def _finish(job, timeout=300):
    """Wait for the job and return its output ("" if :func:`_wait_for`, failing, has read it);
    after ``timeout`` s kill its process group and fail with its output."""
    if job.stdout.closed:
        return ""
    try:
        return job.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        raise AssertionError(f"job still running after {timeout} s:\n{job.communicate()[0][-4000:]}") from None


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
    log = tmp_path / "run" / "metrics.jsonl"
    job, hosts = _elastic_job(tmp_path, ["localhost", "127.0.0.1"], 2, 2,
                              ["--commit-every", "5", "--epochs", str(EPOCHS),
                               "--model", "tests.helpers.models:seed_cnn_rank_checked_dropout"])
    try:
        chief = rank_pid(job, 0)
        _wait_for("the first epoch", lambda: len(_epochs(log)) >= 1, job)
        time.sleep(1.0)  # mid-epoch
        os.kill(chief, signal.SIGKILL)  # rank 0 itself: another process must take over its duties
        _wait_for("an epoch at world size 1", lambda: any(e["world_size"] == 1 for e in _epochs(log)), job)
        with open(hosts, "a") as f:
            f.write(f"{third}:1\n")
    finally:
        out = _finish(job)
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
    # The survivor, rank 1 before the kill, became rank 0 and traced its step again: its dropout
    # masks must now follow rank 0 (the model raises, failing the job, whenever a trace finds a
    # worker's masks keyed by another rank than its current one). The check ran alone at world
    # size 1, after the kill, as well as at world size 2.
    checked = set(re.findall(r"dropout keyed by the current rank (\d) of world size (\d)", out))
    assert {("0", "1"), ("0", "2"), ("1", "2")} <= checked, sorted(checked)


def test_elastic_resume_continues_mid_epoch_at_another_world_size(tmp_path):
    """Kill the whole job after a mid-epoch checkpoint at world size 2; resume it on 1 worker."""
    _resume_mid_epoch_at_another_world_size(tmp_path, [], NUM_TRAIN, 2, 30, 1, "resuming at step")


def test_elastic_image_folder_resumes_mid_epoch_at_another_world_size(tmp_path):
    """The same with an image folder, streamed by tf.data, from 1 worker to 2: each rank reads
    the in-memory plan's indices, so the resumed epoch continues at the checkpoint's example too.
    That example (47 steps x 32 = 1,504) is inside a step of the new global batch (64: step 24
    from 1,472), which then takes the 32 examples from 1,504 on, not the 64 from 1,472."""
    data = make_synthetic(num_train=3000, num_test=200)
    folder = write_image_folder(tmp_path / "folder", data.x_train, data.y_train, data.x_test, data.y_test, fmt="png")
    _resume_mid_epoch_at_another_world_size(tmp_path, ["--dataset", "folder", "--data-dir", folder], 3000, 1, 47, 2,
                                            "resuming at step 24 of epoch 1")


def _resume_mid_epoch_at_another_world_size(tmp_path, data_args, num_train, np_before, checkpoint_every, np_after,
                                            resumed):
    """Kill an elastic job of ``np_before`` workers after its first mid-epoch checkpoint, resume
    it on ``np_after``: the output says ``resumed``, and each epoch trains on every example once."""
    log_dir = tmp_path / "run"
    args = [*data_args, "--model", "tests.helpers.models:cnn_sync_bn", "--epochs", "2"]
    hosts = ["localhost", "127.0.0.1"]

    def mid_epoch_checkpoint():
        return any(json.loads(meta.read_text())["step_in_epoch"]
                   for meta in log_dir.glob("checkpoints/ckpt-*/meta.json"))

    job, _ = _elastic_job(tmp_path, hosts[:np_before], np_before, np_before,
                          [*args, "--checkpoint-every", str(checkpoint_every)])
    try:
        _wait_for("a mid-epoch checkpoint", mid_epoch_checkpoint, job)
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate()
    assert len(_epochs(log_dir / "metrics.jsonl")) < 2

    job, _ = _elastic_job(tmp_path, hosts[:np_after], np_after, np_after, [*args, "--resume"])
    out = _finish(job)
    assert job.returncode == 0, out[-4000:]
    assert resumed in out, out[-3000:]
    epochs = _epochs(log_dir / "metrics.jsonl")
    assert [e["epoch"] for e in epochs] == [1, 2] and epochs[-1]["world_size"] == np_after
    # The resumed epoch continued at the checkpoint's example: with the examples trained before
    # it (carried in the checkpoint's metric sums), each example once.
    assert all(e["train_examples"] == num_train for e in epochs), [e["train_examples"] for e in epochs]


def test_an_interrupted_elastic_run_says_where_to_resume_from(tmp_path):
    """Ctrl-C on the worker of an elastic run without --log-dir: it names the directory it chose."""
    job, _ = _elastic_job(tmp_path, ["localhost"], 1, 1, ["--epochs", "1000", "--checkpoint-every", "20"], log_dir=None)
    said = "hvdtrain: interrupted; the checkpoints written so far are complete: rerun the same command with --resume"
    lines = []
    try:
        _wait_for("a checkpoint", lambda: list(tmp_path.glob("runs/*/checkpoints/ckpt-*")), job)
        reader = threading.Thread(target=lambda: lines.extend(job.stdout), daemon=True)
        reader.start()
        worker = psutil.Process(rank_pid(job, 0))
        worker.send_signal(signal.SIGINT)
        worker.wait(timeout=60)
        # The driver passes the worker's output on, then may wait for other hosts: no exit to wait for.
        deadline = time.time() + 60
        while time.time() < deadline and not any(said in line for line in lines):
            time.sleep(0.2)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    (run_dir,) = [p.relative_to(tmp_path) for p in tmp_path.glob("runs/*")]
    (line,) = [line for line in lines if said in line]
    assert line.endswith(f"{said} --log-dir {run_dir} to continue from the last one\n"), "".join(lines)[-3000:]


def test_launch_script_runs_an_elastic_job_on_this_host(tmp_path):
    """launch/elastic.sh with its default discovery (this host, 2 slots) trains and exits 0."""
    env = rank_env({"VENV": str(BIN.parent), "LOG_DIR": str(tmp_path / "run"),
                    "ARGS": "--dataset synthetic --epochs 1 --threads 1 --no-progress"})
    proc = subprocess.run(["bash", str(REPO / "launch" / "elastic.sh")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    epochs = _epochs(tmp_path / "run" / "metrics.jsonl")
    assert [e["world_size"] for e in epochs] == [2] and epochs[0]["train_examples"] == NUM_TRAIN


def test_launch_script_refuses_more_workers_than_this_host_has_names(tmp_path):
    """launch/elastic.sh on this host alone with more workers to start (NP) than its default
    discovery can list: one error at once, not Horovod's driver waiting 10 minutes for the slots."""
    env = rank_env({"VENV": str(BIN.parent), "NP": "500", "LOG_DIR": str(tmp_path / "run")})
    proc = subprocess.run(["bash", str(REPO / "launch" / "elastic.sh")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert re.search(r"this machine has \d+ names for NP=500 one-slot workers; list hosts in HOSTS_FILE",
                     proc.stderr), proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_worker_added_during_the_last_epoch_does_not_restart_training(tmp_path):
    """A worker added during the only epoch (no commit before its end) is announced at the last
    commit: the job ends there, instead of resetting to run an evaluation with the new worker.

    The model's 100th step (of 188) waits until the discovery script has listed the new host, and
    2 s more for the driver to tell the worker: the announcement always comes before the end."""
    run_dir, discovered = tmp_path / "run", tmp_path / "discovered"
    job, hosts = _elastic_job(tmp_path, ["localhost"], 1, 2,
                              ["--epochs", "1", "--commit-every", "100000", "--model", "tests.helpers.models:mlp_waits_at_step_100"],
                              env={"HVDTRAIN_TEST_WAIT_MARKER": str(discovered)})
    try:
        # The run directory is opened after the first state sync, where an earlier host would join.
        _wait_for("training to start", lambda: (run_dir / "tensorboard").exists(), job)
        with open(hosts, "a") as f:
            f.write("127.0.0.1:1\n")
        script = tmp_path / "discover_hosts.sh"  # from now on it also says that it has listed the host
        (tmp_path / "discover.new").write_text(f"#!/bin/sh\ncat {hosts}\ntouch {discovered}\n")
        (tmp_path / "discover.new").chmod(0o755)
        os.replace(tmp_path / "discover.new", script)
    finally:
        out = _finish(job)
    assert job.returncode == 0, out[-5000:]
    assert discovered.exists(), "the new host was never discovered"
    assert [e["world_size"] for e in _epochs(run_dir / "metrics.jsonl")] == [1]
    assert not (run_dir / "evaluation.json").exists() and "evaluation only" not in out, out[-3000:]


def test_a_worker_that_fails_while_joining_is_left_out(tmp_path):
    """The survivors wait for a joining worker in the state sync; if it fails instead, they go on without it."""
    marker = tmp_path / "joiners-fail"
    log = tmp_path / "run" / "metrics.jsonl"
    job, hosts = _elastic_job(tmp_path, ["localhost"], 1, 2,
                              ["--commit-every", "5", "--model", "tests.helpers.models:fails_where_marker_exists",
                               "--epochs", "6"], env={"HVDTRAIN_TEST_FAIL_MARKER": str(marker)})
    try:
        _wait_for("the first epoch", lambda: len(_epochs(log)) >= 1, job)
        marker.touch()
        with open(hosts, "a") as f:
            f.write("127.0.0.1:1\n")
    finally:
        out = _finish(job)
    assert job.returncode == 0, out[-5000:]
    assert "this worker's start-up fails (test)" in out, out[-3000:]
    epochs = _epochs(log)
    assert [e["epoch"] for e in epochs] == list(range(1, 7)) and {e["world_size"] for e in epochs} == {1}
    assert all(e["train_examples"] == NUM_TRAIN for e in epochs)


def test_a_worker_with_other_data_leaves_and_the_job_goes_on(tmp_path):
    """A worker that joins with another copy of the data (its host's file has other labels) leaves
    with one message; the others go on without it."""
    rng = np.random.default_rng(0)
    n = 6400  # 200 steps per epoch: the job outlasts the joining worker's start-up
    x_train, x_test = rng.integers(0, 256, (n, 8, 8), dtype=np.uint8), rng.integers(0, 256, (64, 8, 8), dtype=np.uint8)
    for host, labels in (("localhost", np.arange(n) % 4), ("127.0.0.1", np.arange(n) % 5)):
        np.savez(tmp_path / f"data_{host}.npz", x_train=x_train, y_train=labels, x_test=x_test, y_test=np.arange(64) % 4)
    log = tmp_path / "run" / "metrics.jsonl"
    job, hosts = _elastic_job(tmp_path, ["localhost"], 1, 2,
                              ["--commit-every", "5", "--epochs", "30", "--model", "tests.helpers.models:mlp", "--dataset",
                               "npz", "--data-dir", str(tmp_path / "data_{host}.npz")],
                              module="tests.workers.per_rank_args")
    try:
        _wait_for("the first epoch", lambda: len(_epochs(log)) >= 1, job)
        with open(hosts, "a") as f:
            f.write("127.0.0.1:1\n")
    finally:
        out = _finish(job)
    assert job.returncode == 0, out[-5000:]
    assert out.count("rank 1 loaded other data than rank 0 (num_classes: 5 here, 4 on rank 0; digest:") == 1, out[-4000:]
    epochs = _epochs(log)
    assert [e["epoch"] for e in epochs] == list(range(1, 31)) and {e["world_size"] for e in epochs} == {1}
    assert all(e["train_examples"] == n for e in epochs)


def test_an_error_in_rank_0s_writes_stops_every_worker_once(tmp_path):
    """A checkpoint that cannot be written ends the elastic job at once, with one message, instead
    of each new rank 0 meeting the same error after a reset."""
    run_dir = tmp_path / "run"
    job, _ = _elastic_job(tmp_path, ["localhost", "127.0.0.1"], 2, 2,
                          ["--model", "tests.helpers.models:cnn_sync_bn", "--epochs", "20"])
    try:
        _wait_for("the first checkpoint", lambda: any(run_dir.glob("checkpoints/ckpt-*/meta.json")), job)
        shutil.rmtree(run_dir / "checkpoints")
        (run_dir / "checkpoints").write_text("a file where the checkpoint directory was\n")
        blocked = time.time()
    finally:
        out = _finish(job, timeout=120)
    seconds = time.time() - blocked
    assert job.returncode != 0, out[-3000:]
    assert out.count("hvdtrain: error: cannot write checkpoint") == 1, out[-5000:]
    assert seconds < 60, f"took {seconds:.0f} s"
    assert len(_epochs(run_dir / "metrics.jsonl")) <= 2
