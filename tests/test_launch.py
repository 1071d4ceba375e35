"""The launch/ scripts. On this host: launch/local.sh, its default (horovodrun over MPI) and plain
mpirun. Across two hosts: network namespaces with their own addresses, joined by a veth pair, sshd
in each; the scripts start one rank per host with mpirun and with horovodrun (Gloo), each from a hostfile,
and both must match the single-host run. Cutting the link must end every rank, not hang it.
"""
import json
import os
import re
import subprocess
import sys
import time

import pytest

from tests.helpers.ranks import REPO, rank_env
from tests.helpers.twohosts import IFACE, TwoHosts, namespaces_supported

REASON = namespaces_supported()
two_hosts = pytest.mark.skipif(bool(REASON), reason=REASON)

VENV = os.path.dirname(os.path.dirname(sys.executable))


def final_test_accuracy(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f][-1]["test_accuracy"]


def test_horovodruns_build_check_answers_without_importing_tensorflow():
    """The launcher's check of how Horovod was built, made on every launch, loads Horovod's
    TensorFlow extension library alone, not all of TensorFlow
    (scripts/horovod-patches/0007-runner-build-check-without-importing-tensorflow.patch)."""
    check = ("import sys; from horovod.common import util; lib = util._extension_library('tensorflow'); "
             "print(lib.gloo_built(), lib.mpi_built(), util.gloo_built(), util.mpi_built(), 'tensorflow' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120,
                            env=rank_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["True", "True", "True", "True", "False"], result.stdout + result.stderr[-3000:]


@pytest.mark.parametrize("mode", ["mpi", "mpirun"])
def test_local_script_trains_on_this_host(tmp_path, mode):
    """launch/local.sh [mode] [flags]: two ranks on this host train and log an epoch, with the
    flags in ARGS and those after the mode; without LD_LIBRARY_PATH set, mpirun is not asked to
    pass it on (it would warn)."""
    env = rank_env({"VENV": VENV, "NP": "2", "ARGS": "--dataset synthetic --model tests.helpers.models:mlp --epochs 1"})
    env.pop("LD_LIBRARY_PATH", None)
    result = subprocess.run(["bash", str(REPO / "launch" / "local.sh"), mode, "--threads", "1", "--no-progress",
                             "--log-dir", str(tmp_path / "run")], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "2 local rank(s) x 1 host(s)" in output and "could not find environment variable" not in output, output
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        assert [json.loads(line)["world_size"] for line in f] == [2]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    with TwoHosts(tmp_path_factory.mktemp("hosts")) as two:
        yield two


def launch(hosts, script, env, timeout=600):
    """Run a launch/ script inside host 0's namespace; return the completed process."""
    env = rank_env({"VENV": VENV, **env})
    result = subprocess.run(hosts.exec_on(0, ["bash", str(REPO / "launch" / script)]), env=env,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{script} exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def write_hostfile(path, hosts) -> None:
    """One slot per host, with the comments and blank lines a hand-kept hostfile has (a commented-out
    host must not count)."""
    first, second = hosts
    path.write_text(f"# the cluster\n{first} slots=1\n\n# retired-node slots=4\n{second} slots=1  # the other\n")


@two_hosts
def test_mpirun_hostfile_across_two_hosts(hosts, tmp_path, fashion_slice_job, fashion_slice_gloo_metrics):
    hostfile = tmp_path / "hostfile"
    write_hostfile(hostfile, hosts.hosts)
    result = launch(hosts, "mpirun_hostfile.sh", {
        "HOSTFILE": str(hostfile), "IFACE": IFACE, "SSH_ARGS": " ".join(hosts.ssh_options()),
        "ARGS": " ".join([*fashion_slice_job, "--log-dir", str(tmp_path / "run")])})
    assert "1 local rank(s) x 2 host(s)" in result.stdout
    assert final_test_accuracy(tmp_path / "run") == pytest.approx(fashion_slice_gloo_metrics["test_accuracy"], abs=0.002)


@two_hosts
def test_horovodrun_gloo_across_two_hosts(hosts, tmp_path, fashion_slice_job, fashion_slice_gloo_metrics):
    hostfile = tmp_path / "hostfile"  # the script turns it into -H: horovodrun's own reader fails on comments
    write_hostfile(hostfile, hosts.hosts)
    result = launch(hosts, "horovodrun_hosts.sh", {
        "HOSTFILE": str(hostfile), "IFACE": IFACE, "SSH_KEY": str(hosts.key),
        "MODE": "gloo", "ARGS": " ".join([*fashion_slice_job, "--log-dir", str(tmp_path / "run")])})
    assert "1 local rank(s) x 2 host(s)" in result.stdout
    assert final_test_accuracy(tmp_path / "run") == pytest.approx(fashion_slice_gloo_metrics["test_accuracy"], abs=0.002)


def rank_pids(hosts):
    pids = []
    for ns in hosts.namespaces:
        for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
            try:
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:
                continue
            if b"-m\0hvdtrain" in cmdline and b"mpirun" not in cmdline:
                pids.append(int(pid))
    return pids


@two_hosts
def test_cut_link_ends_every_rank(hosts, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{h} slots=1\n" for h in hosts.hosts))
    env = rank_env({"VENV": VENV, "HOSTFILE": str(hostfile), "IFACE": IFACE,
                    "SSH_ARGS": " ".join(hosts.ssh_options()),
                    "ARGS": f"--dataset synthetic --model tests.helpers.models:mlp --epochs 100000 --threads 1 "
                            f"--no-progress --stall-timeout 15 --log-dir {tmp_path / 'run'}"})
    log = tmp_path / "job.log"
    job = subprocess.Popen(hosts.exec_on(0, ["bash", str(REPO / "launch" / "mpirun_hostfile.sh")]), env=env,
                           stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 180
        while not (tmp_path / "run" / "metrics.jsonl").exists():
            assert time.time() < deadline and job.poll() is None, "training did not start"
            time.sleep(0.5)
        ranks = rank_pids(hosts)
        assert len(ranks) == 2, f"expected a rank on each host, found {ranks}"
        hosts.cut_link()
        cut = time.time()
        while any(os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z"
                  for pid in ranks):
            assert time.time() - cut < 60, "a rank was still running 60 s after the link was cut"
            time.sleep(0.5)
    finally:
        os.killpg(job.pid, 9)  # the launcher itself may wait long for its lost remote daemon
        job.wait()
    out = log.read_text()
    # The stall watchdog names the silent rank; or, once mpirun signals the ranks on losing its
    # daemon, rank 0's watchdog finds rank 1's heartbeats stopped and names it lost, sooner.
    assert len(re.findall(r"hvdtrain: error: rank \d (made no progress|was lost mid-training)", out)) == 1, out[-3000:]
