"""What reproducible runs cost: training img/s of hvdtrain's default, of --deterministic, and with
Horovod's timing fusion, side by side in one run.

    .venv/bin/python benchmarks/deterministic.py                 # np=2 and np=3, 3 rounds
    .venv/bin/python benchmarks/deterministic.py --np 3 --rounds 5

Runs repeat bit for bit without the flag (hvdtrain's gradient buckets, each fused alone:
``HOROVOD_DISABLE_GROUP_FUSION=1``, ``docs/exchange.md``); ``--deterministic`` adds TensorFlow's op
determinism (deterministic kernels); "fused by timing" is the default job with Horovod's own
``HOROVOD_DISABLE_GROUP_FUSION=0``, which fuses whatever is ready in a cycle (runs then differ in
their last bits at np >= 3). Each round runs the default job (seed CNN, synchronized BatchNorm,
``horovodrun --gloo``) on the first ``--train-examples`` Fashion-MNIST images, in memory, for 2
epochs, once each way in turn; the figure is the last epoch's img/s, and the ratios to the default
per round (medians over rounds printed). np=3 oversubscribes a 2-core machine: its ranks share cores.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import common  # noqa: E402


def job(np_: int, data: str, log_dir: str, deterministic: bool = False, timing_fusion: bool = False) -> float:
    """The last epoch's img/s of one run."""
    args = ["-m", "hvdtrain", "--dataset", "npz", "--data-dir", data, "--epochs", "2", "--no-progress",
            "--log-dir", log_dir, *(["--deterministic"] if deterministic else [])]
    env = common.env_for_ranks({"HOROVOD_DISABLE_GROUP_FUSION": "0"} if timing_fusion else None)
    done = subprocess.run(common.launch_command(np_, args), env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(done.stdout[-2000:] + done.stderr[-3000:])
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f][-1]["images_per_sec"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--np", type=int, nargs="+", default=[2, 3])
    p.add_argument("--rounds", type=common.at_least(1), default=3)
    p.add_argument("--train-examples", type=common.at_least(600), default=12000)
    a = p.parse_args()
    from hvdtrain.config import DEFAULT_DATA_DIR
    from hvdtrain.data.in_memory import load_idx_dir

    d = load_idx_dir(DEFAULT_DATA_DIR)
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "data.npz")
        np.savez(data, x_train=d.x_train[:a.train_examples], y_train=d.y_train[:a.train_examples],
                 x_test=d.x_test[:2000], y_test=d.y_test[:2000])
        rows = []
        for np_ in a.np:
            defaults, deterministics, timings, ratios, timing_ratios = [], [], [], [], []
            for r in range(a.rounds):
                defaults.append(job(np_, data, os.path.join(tmp, f"np{np_}-{r}-default")))
                deterministics.append(job(np_, data, os.path.join(tmp, f"np{np_}-{r}-det"), deterministic=True))
                timings.append(job(np_, data, os.path.join(tmp, f"np{np_}-{r}-timing"), timing_fusion=True))
                ratios.append(deterministics[-1] / defaults[-1])
                timing_ratios.append(defaults[-1] / timings[-1])
                print(f"np={np_} round {r + 1}: default {defaults[-1]:,.0f} img/s, --deterministic "
                      f"{deterministics[-1]:,.0f} img/s ({ratios[-1]:.3f}), fused by timing {timings[-1]:,.0f} "
                      f"img/s (default / it: {timing_ratios[-1]:.3f})", flush=True)
            rows.append([np_, f"{statistics.median(defaults):,.0f}", f"{statistics.median(deterministics):,.0f}",
                         f"{statistics.median(ratios):.3f}", f"{min(ratios):.3f}", f"{max(ratios):.3f}",
                         f"{statistics.median(timings):,.0f}", f"{statistics.median(timing_ratios):.3f}"])
        common.print_table(["np", "default img/s", "--deterministic img/s", "ratio (median of rounds)", "min", "max",
                            "fused by timing img/s", "default / fused by timing (median of rounds)"],
                           rows, title=f"{a.train_examples:,} images, seed CNN, 2 epochs, last epoch's img/s, "
                                       f"{a.rounds} round(s)")

if __name__ == "__main__":
    main()
