"""Streamed datasets in one process: TFRecord files and image folders made for a test, and the
batches every rank of a world size would read."""
import os

import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.data.in_memory import make_synthetic
from hvdtrain.data.labels import check_labels
from hvdtrain.data.sharding import ShardPlan
from hvdtrain.data import tfrecord
from hvdtrain.tools import make_tfrecords
from hvdtrain.tools.make_image_folder import write_image_folder


def write_records(directory, counts, prefix="train", label_of=lambda i: i % 3, shape=(4, 4, 1), broken=()):
    """TFRecord files ``<prefix>-<k>`` of ``counts[k]`` records; record ``i`` overall has a PNG of
    value ``i % 256`` and label ``label_of(i)``, or where ``i`` is in ``broken``, bytes that are
    no image (a truncated JPEG). Returns the paths."""
    paths, i = [], 0
    for k, n in enumerate(counts):
        path = os.path.join(directory, f"{prefix}-{k:05d}")
        with tf.io.TFRecordWriter(path) as writer:
            for _ in range(n):
                png = (b"\xff\xd8\xff\xe0 truncated" if i in broken
                       else tf.io.encode_png(np.full(shape, i % 256, np.uint8)).numpy())
                writer.write(make_tfrecords._example(tf, png, label_of(i), "c", f"{i}.png").SerializeToString())
                i += 1
        paths.append(path)
    return paths


def open_records(directory, **kwargs):
    train, test = tfrecord.find_files(str(directory))
    index, scanned = tfrecord.load_index(str(directory), train + test, "image/encoded", "image/class/label")
    args = dict(num_classes=0, image_size=0, augment="none", shuffle_buffer=7, seed=3, check_labels=check_labels)
    args.update(kwargs)
    opened = tfrecord.open_tfrecords(str(directory), index, "image/encoded", "image/class/label", **args)
    if scanned:
        tfrecord.save_index(str(directory), index, "image/encoded", "image/class/label")
    return opened


def epoch_of(dataset, world_size, batch, epoch, first_step=0, first_example=0):
    """Every rank's batches of ``epoch`` (as ``[rank][step] -> (images, labels)``), and the plans."""
    plans = [ShardPlan(dataset.num_train, batch, world_size, r, seed=3) for r in range(world_size)]
    ranks = []
    for plan in plans:
        batches, sizes = dataset.train_batches(plan, epoch, first_step, first_example)
        got = [(x.numpy(), y.numpy()) for x, y in batches]
        assert [len(y) for _, y in got] == sizes
        ranks.append(got)
    return ranks, plans


@pytest.fixture(scope="module")
def small_folder(tmp_path_factory):
    data = make_synthetic(num_train=23, num_test=7, image_shape=(6, 6, 1), num_classes=3, seed=1)
    root = write_image_folder(tmp_path_factory.mktemp("folder"), data.x_train, data.y_train, data.x_test,
                              data.y_test, fmt="png")
    return root, data
