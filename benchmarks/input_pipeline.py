"""Does the streamed input keep up with training? The input pipeline's own images/s per core, the
training step's demand, and streamed against in-memory training img/s, side by side in one run.

    .venv/bin/python benchmarks/input_pipeline.py                 # Fashion-MNIST's 60,000 training images
    .venv/bin/python benchmarks/input_pipeline.py --train-examples 12000 --rounds 3

Makes, in a temporary directory, the first ``--train-examples`` Fashion-MNIST training images (and
2,000 test images) as a PNG folder, as TFRecord shards of it (``make_tfrecords``) and as an NPZ file
in the folder's order. Then:

1. *pipeline alone*: ``python -m hvdtrain.tools.input_speed`` on one core reads one epoch of
   ``--dataset folder`` and ``tfrecord`` batches (decode, crop, augment; no model), with
   ``--augment none`` and with ``standard`` (random-resized-crop and flip at ``--image-size 28``);
2. *training*: ``--rounds`` rounds of np=2 jobs (``horovodrun --gloo``, the default CNN, 2 epochs)
   on the NPZ (in memory), the folder and the TFRecords, in turn; each job's last-epoch img/s, and
   per round the streamed / in-memory ratio (the median over rounds is printed). The in-memory
   job's img/s per rank is the step's demand the pipeline must meet on its rank's core.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import common  # noqa: E402


def make_data(root: str, train_examples: int) -> dict:
    from hvdtrain.config import DEFAULT_DATA_DIR
    from hvdtrain.data.in_memory import load_idx_dir
    from hvdtrain.tools import make_tfrecords
    from hvdtrain.tools.make_image_folder import folder_order, write_image_folder

    d = load_idx_dir(DEFAULT_DATA_DIR)
    x, y, xt, yt = d.x_train[:train_examples], d.y_train[:train_examples], d.x_test[:2000], d.y_test[:2000]
    folder = write_image_folder(os.path.join(root, "folder"), x, y, xt, yt, fmt="png")
    o, ot = folder_order(y), folder_order(yt)
    np.savez(os.path.join(root, "data.npz"), x_train=x[o], y_train=y[o], x_test=xt[ot], y_test=yt[ot])
    records = os.path.join(root, "records")
    make_tfrecords.main(["--folder", folder, "--out", records, "--shards", "8"])
    return {"npz": os.path.join(root, "data.npz"), "folder": folder, "tfrecord": records}


def pipeline_alone(kind: str, path: str, augment: str, batch_size: int) -> float:
    """Images/s of one epoch of the streamed pipeline on one core, no model (``input_speed``, a fresh process)."""
    size = "28" if augment == "standard" else "0"
    out = subprocess.run([sys.executable, "-m", "hvdtrain.tools.input_speed", "--dataset", kind, "--data-dir", path,
                          "--augment", augment, "--image-size", size, "--threads", "1", "--batch-size",
                          str(batch_size)], capture_output=True, text=True, cwd=REPO, env=common.env_for_ranks())
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return float(out.stdout.split(" img/s")[0].replace(",", ""))


def train(kind: str, path: str, run_dir: str, epochs: int) -> float:
    """Last-epoch img/s of an np=2 job of the default model on ``kind`` data."""
    args = ["-m", "hvdtrain", "--dataset", kind, "--data-dir", path, "--epochs", str(epochs), "--no-progress",
            "--log-dir", run_dir]
    out = subprocess.run(common.launch_command(2, args), capture_output=True, text=True, cwd=REPO,
                         env=common.env_for_ranks())
    if out.returncode:
        raise SystemExit(out.stdout[-2000:] + out.stderr[-3000:])
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return json.loads(f.readlines()[-1])["images_per_sec"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--train-examples", type=common.at_least(512), default=60000,
                   help="the first this many Fashion-MNIST training images (60,000: all of them)")
    p.add_argument("--rounds", type=common.at_least(1), default=2)
    p.add_argument("--epochs", type=common.at_least(2), default=2, help="per training job; the last one is timed")
    p.add_argument("--batch-size", type=common.at_least(1), default=128)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        began = time.perf_counter()
        paths = make_data(tmp, a.train_examples)
        print(f"data: {a.train_examples:,} Fashion-MNIST training images as PNG folder, TFRecords and NPZ "
              f"({time.perf_counter() - began:.0f} s)")
        rows = [[kind, augment, f"{pipeline_alone(kind, paths[kind], augment, a.batch_size):,.0f}"]
                for kind in ("folder", "tfrecord") for augment in ("none", "standard")]
        common.print_table(["dataset", "augment", "pipeline alone, img/s on one core"], rows,
                                 "1. the input pipeline alone (decode, crop, augment; no model)")
        rates = {kind: [] for kind in ("npz", "folder", "tfrecord")}
        for r in range(a.rounds):
            for kind in rates:
                rates[kind].append(train(kind, paths[kind], os.path.join(tmp, f"run-{kind}-{r}"), a.epochs))
        rows = [[kind if kind != "npz" else "in memory (npz)", *[f"{v:,.0f}" for v in values],
                 f"{values and statistics.median(v / m for v, m in zip(values, rates['npz'])):.3f}"]
                for kind, values in rates.items()]
        common.print_table(["data", *[f"round {r + 1} img/s" for r in range(a.rounds)], "/ in memory (median)"],
                                 rows, "2. training at np=2 (default CNN, last epoch; paired by round)")
        demand = statistics.median(rates["npz"]) / 2
        print(f"the training step's demand: {demand:,.0f} img/s per rank (in-memory img/s / 2 ranks, one core each)")


if __name__ == "__main__":
    main()
