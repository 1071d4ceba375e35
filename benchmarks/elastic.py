"""Elastic training on real data: a normal run against one that loses rank 0 and gets a worker back.

    .venv/bin/python benchmarks/elastic.py [--epochs 12] [--kill-after 3]

Both train hvdtrain's default job (seed CNN with synchronized BatchNorm, Fashion-MNIST, local batch
128, base LR 0.05 scaled by world size) on 2 workers with one thread each:

* **normal**: ``horovodrun -np 2 --gloo``, nothing happens to it;
* **elastic**: ``horovodrun -np 2 --min-np 1 --max-np 2`` with a host-discovery script listing this
  machine twice (``localhost:1``, ``127.0.0.1:1``) and ``--elastic --commit-every 20``. Shortly
  after epoch ``--kill-after`` ends, rank 0 is killed (SIGKILL) mid-epoch; the other worker rolls
  back to its last commit and goes on alone (as rank 0, at half the learning rate). After it
  finished an epoch alone, the machine's own IPv4 address is added to the list, a new worker
  joins, receives the state, and the job ends on 2 workers again.

Prints both runs' test accuracy per epoch with the world size, and the final difference (target:
within 1 percentage point), and writes a PNG plot.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

import common


def epochs_logged(run_dir: Path) -> list:
    log = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []


def rank0_pid(job: subprocess.Popen) -> int:
    """The worker the elastic driver started as rank 0 (HOROVOD_RANK=0 in its environment)."""
    for _ in range(600):
        for proc in psutil.Process(job.pid).children(recursive=True):
            try:
                if "hvdtrain" in " ".join(proc.cmdline()) and proc.environ().get("HOROVOD_RANK") == "0":
                    return proc.pid
            except psutil.Error:
                continue
        time.sleep(0.1)
    raise SystemExit("rank 0 of the elastic job not found")


def wait_until(condition, job: subprocess.Popen, log: Path, what: str, timeout: float = 1800) -> None:
    """Wait for ``condition()``; if the job ends or ``timeout`` s pass first, end the job's process
    group and exit with the end of its output (``log``)."""
    deadline = time.time() + timeout
    while not condition():
        if job.poll() is not None or time.time() > deadline:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
            raise SystemExit(f"elastic job ended (exit {job.returncode}) or timed out before {what}:\n"
                             f"{log.read_text()[-4000:]}")
        time.sleep(0.5)


def own_ipv4() -> str:
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family.name == "AF_INET" and not a.address.startswith("127."):
                return a.address
    raise SystemExit("no non-loopback IPv4 address: cannot add a third local host")


def run(argv: list) -> float:
    start = time.time()
    proc = subprocess.run(argv, cwd=common.REPO, env=common.env_for_ranks({"CUDA_VISIBLE_DEVICES": ""}),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"job failed: {' '.join(argv)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return time.time() - start


def run_elastic(train_args: list, run_dir: Path, work: Path, kill_after: int) -> float:
    hosts = work / "hosts"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")
    discover = work / "discover_hosts.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    argv = [str(common.BIN / "horovodrun"), "-np", "2", "--min-np", "1", "--max-np", "2",
            "--host-discovery-script", str(discover), sys.executable, *train_args,
            "--elastic", "--commit-every", "20", "--log-dir", str(run_dir)]
    log = work / "elastic.log"  # a file, not a pipe: nothing reads the job's output while it runs
    start = time.time()
    with open(log, "w") as out:
        job = subprocess.Popen(argv, cwd=common.REPO, env=common.env_for_ranks({"CUDA_VISIBLE_DEVICES": ""}),
                               stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        chief = rank0_pid(job)
        wait_until(lambda: len(epochs_logged(run_dir)) >= kill_after, job, log, f"epoch {kill_after}")
        time.sleep(3.0)  # into the next epoch
        os.kill(chief, signal.SIGKILL)
        print(f"killed rank 0 (pid {chief}) in epoch {kill_after + 1}", flush=True)
        wait_until(lambda: any(e["world_size"] == 1 for e in epochs_logged(run_dir)), job, log, "an epoch alone")
        with open(hosts, "a") as f:
            f.write(f"{own_ipv4()}:1\n")
        print(f"added a worker after epoch {len(epochs_logged(run_dir))}", flush=True)
        wait_until(lambda: job.poll() is not None, job, log, "the end of training")
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    if job.returncode != 0:
        raise SystemExit(f"elastic job failed (exit {job.returncode}):\n{log.read_text()[-5000:]}")
    return time.time() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=common.positive_int, default=12)
    p.add_argument("--kill-after", type=common.positive_int, default=3,
                   help="kill rank 0 shortly after this epoch ends")
    p.add_argument("--data-dir", default=common.FASHION_MNIST)
    p.add_argument("--plot", default=str(common.REPO / "benchmarks" / "figures" / "elastic.png"))
    a = p.parse_args()
    if a.epochs < a.kill_after + 2:  # one epoch alone after the kill, then one with the worker back
        p.error(f"--epochs must be at least --kill-after + 2, got --epochs {a.epochs} --kill-after {a.kill_after}")
    train_args = ["-m", "hvdtrain", "--data-dir", a.data_dir, "--epochs", str(a.epochs), "--threads", "1",
                  "--no-progress"]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        seconds = {"normal": run(common.launch_command(2, [*train_args, "--log-dir", str(work / "normal")])),
                   "elastic": run_elastic(train_args, work / "elastic", work, a.kill_after)}
        runs = {name: epochs_logged(work / name) for name in seconds}
        short = {name: len(r) for name, r in runs.items() if len(r) != a.epochs}
        if short:
            raise SystemExit(f"expected {a.epochs} epochs logged by each job, got {short}")
        if runs["elastic"][-1]["world_size"] != 2:
            print("the worker added back did not join; the elastic job's output ends:\n"
                  + (work / "elastic.log").read_text()[-6000:], flush=True)

    rows = [[e + 1, f"{runs['normal'][e]['test_accuracy']:.4f}", runs["elastic"][e]["world_size"],
             f"{runs['elastic'][e]['test_accuracy']:.4f}", runs["elastic"][e]["train_examples"]]
            for e in range(a.epochs)]
    common.print_table(["epoch", "normal: test acc", "elastic: world size", "elastic: test acc",
                        "elastic: examples"], rows, title="Test accuracy per epoch (2 workers; elastic: rank 0 "
                                                          f"killed in epoch {a.kill_after + 1}, a worker added back)")
    final = {name: r[-1]["test_accuracy"] for name, r in runs.items()}
    diff = final["elastic"] - final["normal"]
    print(f"\nfinal test accuracy: normal {final['normal']:.4f}, elastic {final['elastic']:.4f}, difference "
          f"{100 * diff:+.2f} points (target: within 1); wall time {seconds['normal']:.0f} s and "
          f"{seconds['elastic']:.0f} s", flush=True)

    plt = common.matplotlib_pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, style in (("normal", "o-"), ("elastic", "s--")):
        ax.plot([e["epoch"] for e in runs[name]], [e["test_accuracy"] for e in runs[name]], style, label=name)
    for e in runs["elastic"]:
        if e["world_size"] == 1:
            ax.axvspan(e["epoch"] - 0.5, e["epoch"] + 0.5, color="0.9")
    ax.set_xlabel("epoch (shaded: elastic job on 1 worker)")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"Fashion-MNIST, seed CNN: final {final['normal']:.4f} vs {final['elastic']:.4f}")
    ax.legend()
    common.save_plot(fig, a.plot)


if __name__ == "__main__":
    main()
