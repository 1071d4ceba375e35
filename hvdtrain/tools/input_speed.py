"""Can this host feed its GPUs? The input pipeline's own speed, with no model: ``input_speed``.

    python -m hvdtrain.tools.input_speed --dataset folder --data-dir imagenet/ --image-size 224 \\
        --augment standard --threads 1 --target 3000

reads the dataset through exactly the pipeline a training run's rank uses (reading, decoding, the
crop, the augmentation and the batching of :class:`hvdtrain.data.stream.StreamingDataset`, on
``--threads`` threads pinned to as many cores) and prints::

    612 img/s on 1 thread(s)
    4.9 cores per GPU at 3,000 img/s (612 img/s per core)

A GPU training at ``--target`` img/s needs that many of its host's cores for input alone; the
rank's step, Horovod and the launcher want cores of their own. Time runs from the first
batch asked for (the graph already built). Exit status: 0, or 2 on an error.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import List, Optional

import tensorflow as tf

from hvdtrain.config import AUGMENTATIONS, DataConfig
from hvdtrain.errors import FoundHere, HvdtrainError
from hvdtrain.console import say


def pin(threads: int) -> tuple:
    """Confine this process to ``threads`` of its CPUs (whole physical cores first), so that the
    figure is per core; all of them where it may run on fewer. Returns the CPUs."""
    from hvdtrain.runtime import placement

    cpus = sorted(os.sched_getaffinity(0))
    topology = {cpu: placement.cpu_topology(cpu) for cpu in cpus}
    chosen = tuple(cpu for core in placement.physical_cores(cpus, topology) for cpu in core)[:threads]
    os.sched_setaffinity(0, chosen)
    return chosen


def batches(data: DataConfig, split: str, batch_size: int, threads: int, seed: int = 0):
    """``(dataset, images in the split, explain)``: the split's batches as rank 0 of a one-process
    run reads them, and ``explain(error, batches_read)``, the :class:`HvdtrainError` naming the
    image a failed read stopped at (as a training run names it)."""
    from hvdtrain.data.loading import open_dataset
    from hvdtrain.data.sharding import ShardPlan
    from hvdtrain.runtime.dist import DistContext
    from hvdtrain.runtime.watchdog import Watchdog

    ctx = DistContext(rank=0, local_rank=0, size=1, local_size=1, cross_size=1, device="/CPU:0",
                      cpu_cores=tuple(sorted(os.sched_getaffinity(0))), intra_op_threads=threads)
    opened = open_dataset(ctx, data, seed, Watchdog(lambda: 0, 0.0))
    if split == "train":
        plan = ShardPlan(opened.num_train, batch_size, 1, 0, seed)
        return (opened.train_batches(plan, 0, threads=threads)[0], opened.num_train,
                lambda error, read: opened.failed_step(error, plan, 0, read, 0))
    return (opened.test_batches(1, 0, batch_size, threads), opened.num_test,
            lambda error, read: opened.failed_evaluation(error, 1, 0))


def measure(data, limit: int, explain=None) -> tuple:
    """``(images read, seconds)``: ``data``'s batches from the start (filling the pipeline is
    decoding work too; the clock starts once the iterator is built), stopping after ``limit``
    images (0: the whole split). Batches decoded ahead but not yet taken are not counted: a
    figure errs low, never high.

    Raises:
        HvdtrainError: ``explain(error, batches read)`` for a read that failed (with ``explain``).
    """
    count, read = 0, 0
    try:
        batches = iter(data)  # built off the clock: it reads nothing until the first batch is asked for
        start = time.perf_counter()
        for images, _ in batches:
            count, read = count + int(images.shape[0]), read + 1
            if limit and count >= limit:
                break
    except tf.errors.OpError as e:
        if explain is None:
            raise
        raise explain(e, read) from e
    return count, time.perf_counter() - start


def parse(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hvdtrain.tools.input_speed", description=__doc__.split("\n")[0])
    p.add_argument("--dataset", choices=("folder", "tfrecord"), required=True)
    p.add_argument("--data-dir", required=True, help="the image folder or TFRecord directory")
    p.add_argument("--image-size", type=int, default=0, help="side of the square view (0: the stored size)")
    p.add_argument("--augment", choices=AUGMENTATIONS, default="none")
    p.add_argument("--split", choices=("train", "test"), default="train",
                   help="train: the training view (augmented); test: evaluation's center crop")
    p.add_argument("--threads", type=int, default=1, help="input threads, pinned to as many cores (default 1)")
    p.add_argument("--batch-size", type=int, default=128, help="the local batch (default 128)")
    p.add_argument("--images", type=int, default=0, help="stop after timing this many images (0: the whole split)")
    p.add_argument("--target", type=float, default=3000.0, help="img/s one GPU trains at (default 3000)")
    a = p.parse_args(argv)
    for name in ("threads", "batch_size"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.images < 0 or a.target <= 0:
        p.error(f"--images must be >= 0 and --target > 0, got {a.images} and {a.target}")
    return a


def main(argv: Optional[List[str]] = None) -> int:
    a = parse(argv)
    try:
        data = DataConfig(dataset=a.dataset, data_dir=a.data_dir, image_size=a.image_size, augment=a.augment)
        cpus = pin(a.threads)
        tf.config.threading.set_intra_op_parallelism_threads(a.threads)
        tf.config.threading.set_inter_op_parallelism_threads(a.threads)
        split, size, explain = batches(data, a.split, a.batch_size, a.threads)
        count, seconds = measure(split, a.images, explain)
    except (HvdtrainError, FoundHere) as e:  # an image that does not decode, too: training would stop on it
        say(f"input_speed: error: {getattr(e, 'error', e)}", sys.stderr)
        return 2
    rate = count / seconds
    per_core = rate / len(cpus)
    print(f"{rate:,.0f} img/s on {a.threads} thread(s)")
    print(f"{math.ceil(a.target / per_core * 10) / 10:,.1f} cores per GPU at {a.target:,.0f} img/s "
          f"({per_core:,.0f} img/s per core; {count:,} of the {a.split} split's {size:,} images timed on "
          f"{len(cpus)} core(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
