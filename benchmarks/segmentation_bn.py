"""Segmentation at a small local batch: held-out mean IoU with synchronized against per-rank BatchNorm.

    .venv/bin/python benchmarks/segmentation_bn.py                   # 2 seeds, 4,000 images, 1 epoch
    .venv/bin/python benchmarks/segmentation_bn.py --seeds 0 1 2 --train 8000 --epochs 2

Makes the per-pixel Fashion-MNIST task (``hvdtrain.tools.make_segmentation``: the garment's
pixels labelled with its class + 1, background 0), trains the built-in U-Net at np=2
(``horovodrun --gloo``) with local batch ``--batch-size`` (2: BatchNorm of per-rank statistics
sees 2 images), once with synchronized BatchNorm and once with ``--no-sync-bn``, for each seed,
and prints the held-out accuracy and mean IoU of each and their difference per seed.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import common  # noqa: E402


def train(npz: str, run_dir: str, seed: int, a, sync_bn: bool) -> dict:
    args = ["-m", "hvdtrain", "--dataset", "npz", "--data-dir", npz, "--model", "unet", "--metrics",
            "accuracy,mean_iou", "--batch-size", str(a.batch_size), "--epochs", str(a.epochs), "--lr", str(a.lr),
            "--seed", str(seed), "--threads", "1", "--no-progress", "--log-dir", run_dir]
    out = subprocess.run(common.launch_command(2, args + ([] if sync_bn else ["--no-sync-bn"])), capture_output=True,
                         text=True, cwd=REPO, env=common.env_for_ranks())
    if out.returncode:
        sys.exit(f"training failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f][-1]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--train", type=int, default=4000, help="training images (of 60,000)")
    p.add_argument("--test", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=2, help="local batch per rank")
    p.add_argument("--lr", type=float, default=0.02, help="base learning rate of one rank")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        npz = os.path.join(tmp, "seg.npz")
        subprocess.run([sys.executable, "-m", "hvdtrain.tools.make_segmentation", "--out", npz, "--train",
                        str(a.train), "--test", str(a.test)], check=True, cwd=REPO, capture_output=True)
        print(f"U-Net, np=2 x local batch {a.batch_size}, {a.train:,} train / {a.test:,} held-out images, "
              f"{a.epochs} epoch(s)")
        print(f"{'seed':>4}  {'sync acc':>8} {'sync mIoU':>9}  {'per-rank acc':>12} {'per-rank mIoU':>13}  "
              f"{'mIoU sync - per-rank':>20}")
        gains = []
        for seed in a.seeds:
            sync = train(npz, os.path.join(tmp, f"sync{seed}"), seed, a, True)
            local = train(npz, os.path.join(tmp, f"local{seed}"), seed, a, False)
            gains.append(sync["test_mean_iou"] - local["test_mean_iou"])
            print(f"{seed:>4}  {sync['test_accuracy']:>8.4f} {sync['test_mean_iou']:>9.4f}  "
                  f"{local['test_accuracy']:>12.4f} {local['test_mean_iou']:>13.4f}  {gains[-1]:>+20.4f}", flush=True)
        print(f"mean mIoU gain of synchronized BatchNorm: {sum(gains) / len(gains):+.4f} over {len(gains)} seed(s)")


if __name__ == "__main__":
    main()
