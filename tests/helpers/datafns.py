"""Data functions for tests, importable by ranks as ``--data tests.helpers.datafns:<function>``
(:mod:`hvdtrain.data.function` describes the contract)."""
import os

import numpy as np
import tensorflow as tf

SLICE = int(os.environ.get("HVDTRAIN_TEST_SLICE", "6000"))  # training examples of fashion()


def _fashion_arrays(split):
    from hvdtrain.config import DEFAULT_DATA_DIR
    from hvdtrain.data.in_memory import load_idx_dir

    d = load_idx_dir(DEFAULT_DATA_DIR)
    return (d.x_train[:SLICE], d.y_train[:SLICE]) if split == "train" else (d.x_test[:1000], d.y_test[:1000])


def fashion(split, rank, world_size, seed, epoch):
    """Fashion-MNIST (a slice) in memory, shuffled by (seed, epoch): the same order on every rank."""
    x, y = _fashion_arrays(split)
    data = tf.data.Dataset.from_tensor_slices((x, y))
    if split == "train":
        data = data.shuffle(len(y), seed=seed * 1000 + epoch, reshuffle_each_iteration=False)
    return data


def counted(split, rank, world_size, seed, epoch):
    """13 training and 5 test examples, 4x4x1 uint8, image value = example index, label = index % 3."""
    n = 13 if split == "train" else 5
    x = np.arange(n, dtype=np.uint8)[:, None, None, None] * np.ones((1, 4, 4, 1), np.uint8)
    return tf.data.Dataset.from_tensor_slices((x, np.arange(n, dtype=np.int64) % 3))


def counted_maps(split, rank, world_size, seed, epoch):
    """:func:`counted` with a 4x4 label map per image (segmentation): (index + row) % 3 per pixel."""
    x, _ = next(iter(counted(split, rank, world_size, seed, epoch).batch(100)))
    maps = (np.arange(len(x))[:, None, None] + np.arange(4)[None, :, None] + np.zeros((1, 1, 4), int)) % 3
    return tf.data.Dataset.from_tensor_slices((x, maps))


def unknown_length(split, rank, world_size, seed, epoch):
    """:func:`counted` behind a filter: tf.data does not know its length, so hvdtrain counts it."""
    return counted(split, rank, world_size, seed, epoch).filter(lambda x, y: True)


def raises(split, rank, world_size, seed, epoch):
    raise FileNotFoundError("gs://no-such-bucket/train-*")


def images_only(split, rank, world_size, seed, epoch):
    return counted(split, rank, world_size, seed, epoch).map(lambda x, y: x)


def batched(split, rank, world_size, seed, epoch):
    return counted(split, rank, world_size, seed, epoch).batch(4)


def not_a_dataset(split, rank, world_size, seed, epoch):
    return np.zeros((13, 4, 4, 1), np.uint8)


def label_out_of_range(split, rank, world_size, seed, epoch):
    """Labels 0..2 but one 7 among them (given --num-classes 3, it is out of range at run time)."""
    return counted(split, rank, world_size, seed, epoch).map(lambda x, y: (x, tf.where(y == 2, tf.constant(7, tf.int64), y)))


def shrinks(split, rank, world_size, seed, epoch):
    """Fashion's slice, but one example fewer from the second epoch on."""
    data = fashion(split, rank, world_size, seed, epoch)
    return data.take(SLICE - 1) if split == "train" and epoch > 0 else data


def infinite(split, rank, world_size, seed, epoch):
    return counted(split, rank, world_size, seed, epoch).repeat()
