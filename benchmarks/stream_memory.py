"""Peak resident memory per rank as the dataset grows: streamed from an image folder against the
same images in memory (NPZ), side by side in one run.

    .venv/bin/python benchmarks/stream_memory.py                    # 1x, 10x, 100x of 600 images
    .venv/bin/python benchmarks/stream_memory.py --base 1000 --factors 1 10

Writes random 32x32x3 PNG images (``--base`` x factor training images, 10% as many test images,
10 classes) as a folder and as an NPZ file, trains one epoch of the seed CNN at np=2
(``horovodrun --gloo``, local batch 64) on each, and prints every rank's peak RSS
(``getrusage``'s ``ru_maxrss``) and the streamed / in-memory ratio per size. The in-memory path
holds the whole training set in each rank (and on its device); the streamed one a few batches.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import common  # noqa: E402


def worker(argv) -> None:
    """One rank: train with ``argv``, then print this rank's peak RSS in MiB as JSON."""
    from hvdtrain.cli import main as hvdtrain_main
    from hvdtrain.runtime.launcher import launcher_rank

    status = hvdtrain_main(argv)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    print(json.dumps({"rank": launcher_rank(), "peak_rss_mib": rss}), flush=True)
    sys.exit(status)


def make_data(root: str, n_train: int) -> dict:
    from hvdtrain.tools.make_image_folder import folder_order, write_image_folder

    rng = np.random.default_rng(0)
    n_test = max(10, n_train // 10)
    x = rng.integers(0, 256, (n_train + n_test, 32, 32, 3), dtype=np.uint8)
    y = np.arange(n_train + n_test) % 10
    folder = write_image_folder(os.path.join(root, "folder"), x[:n_train], y[:n_train], x[n_train:], y[n_train:],
                                fmt="png")
    o, ot = folder_order(y[:n_train]), folder_order(y[n_train:])
    npz = os.path.join(root, "data.npz")
    np.savez(npz, x_train=x[:n_train][o], y_train=y[:n_train][o], x_test=x[n_train:][ot], y_test=y[n_train:][ot])
    return {"folder": folder, "npz": npz}


def peak_rss(kind: str, path: str, run_dir: str) -> list:
    args = [__file__, "--worker", "--dataset", kind, "--data-dir", path, "--epochs", "1", "--batch-size", "64",
            "--no-progress", "--log-dir", run_dir]
    out = subprocess.run(common.launch_command(2, args), capture_output=True, text=True, cwd=REPO,
                         env=common.env_for_ranks())
    if out.returncode:
        raise SystemExit(out.stdout[-2000:] + out.stderr[-3000:])
    found = {}
    for line in out.stdout.splitlines():
        text = line.split(":", 1)[-1].strip()
        if text.startswith('{"rank"'):
            record = json.loads(text)
            found[record["rank"]] = record["peak_rss_mib"]
    return [found[r] for r in sorted(found)]


def main() -> None:
    if "--worker" in sys.argv:
        worker([a for a in sys.argv[1:] if a != "--worker"])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", type=common.at_least(128), default=600,
                   help="training images at factor 1 (at least one global batch: 2 x 64)")
    p.add_argument("--factors", type=int, nargs="+", default=[1, 10, 100])
    a = p.parse_args()
    rows = []
    for factor in a.factors:
        n = a.base * factor
        with tempfile.TemporaryDirectory() as tmp:
            paths = make_data(tmp, n)
            size_mib = n * 32 * 32 * 3 / 2**20
            streamed = peak_rss("folder", paths["folder"], os.path.join(tmp, "run-folder"))
            in_memory = peak_rss("npz", paths["npz"], os.path.join(tmp, "run-npz"))
            rows.append([f"{factor}x: {n:,} images ({size_mib:,.0f} MiB of pixels)",
                         " / ".join(f"{v:,.0f}" for v in streamed), " / ".join(f"{v:,.0f}" for v in in_memory),
                         f"{max(streamed) / max(in_memory):.2f}"])
            print(f"done: {rows[-1]}", flush=True)
    common.print_table(["training set", "streamed (folder): peak RSS MiB, rank 0 / 1",
                        "in memory (npz): peak RSS MiB, rank 0 / 1", "streamed / in memory"], rows,
                       "peak resident memory per rank, one epoch at np=2 (seed CNN, local batch 64)")


if __name__ == "__main__":
    main()
