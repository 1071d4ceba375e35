"""Convert an image folder (``train/<class>/*.jpg``, ``test/<class>/...``) to TFRecord shards.

    python -m hvdtrain.tools.make_tfrecords --folder images/ --out records/ --shards 16

writes ``records/train-00000-of-00016`` ... and ``records/test-00000-of-000NN`` of
``tf.train.Example`` records in the ImageNet TFRecord convention: ``image/encoded`` (the file's
bytes, not re-encoded), ``image/class/label`` (int64, the class folder's index in sorted order, as
``--dataset folder`` numbers them), ``image/class/text``, ``image/filename``. The examples are
shuffled (``--seed``) before they are cut into shards, so that each shard mixes the classes. Each
shard appears whole: written under a temporary name, then renamed.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from hvdtrain.errors import HvdtrainError
from hvdtrain.console import say


def _example(tf, encoded: bytes, label: int, text: str, filename: str):
    def feature(**kind):
        return tf.train.Feature(**kind)

    return tf.train.Example(features=tf.train.Features(feature={
        "image/encoded": feature(bytes_list=tf.train.BytesList(value=[encoded])),
        "image/class/label": feature(int64_list=tf.train.Int64List(value=[label])),
        "image/class/text": feature(bytes_list=tf.train.BytesList(value=[text.encode()])),
        "image/filename": feature(bytes_list=tf.train.BytesList(value=[filename.encode()])),
    }))


def write_split(paths, labels, names, out_dir: str, prefix: str, shards: int, seed: int) -> int:
    """Write one split's images as ``shards`` TFRecord files ``<prefix>-SSSSS-of-NNNNN``.

    Args:
        paths, labels, names: the split's image files, their class indices and the class names
            (:func:`hvdtrain.data.folder.list_split`; paths as bytes).
        out_dir: the output directory.
        prefix: ``train``, ``test`` or ``validation``.
        shards: files to write (at most one per image).
        seed: the order of the examples across and within the files.

    Returns:
        The number of records written.

    Raises:
        OSError, tf.errors.OpError: for an image that cannot be read or a file that cannot be written.
    """
    import tensorflow as tf

    order = np.random.default_rng(seed).permutation(len(paths))
    shards = max(1, min(shards, len(paths)))
    for shard, part in enumerate(np.array_split(order, shards)):
        name = f"{prefix}-{shard:05d}-of-{shards:05d}"
        path, tmp = os.path.join(out_dir, name), os.path.join(out_dir, f".{name}.tmp")  # hidden from train-*
        with tf.io.TFRecordWriter(tmp) as writer:
            for i in part:
                with open(paths[i], "rb") as f:
                    encoded = f.read()
                writer.write(_example(tf, encoded, int(labels[i]), names[labels[i]],
                                      os.fsdecode(os.path.basename(paths[i]))).SerializeToString())
        os.replace(tmp, path)
    return len(paths)


def main(argv=None) -> int:
    """Command line (see the module); returns the exit status: 0, or 2 after one error line."""
    p = argparse.ArgumentParser(prog="python -m hvdtrain.tools.make_tfrecords", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--folder", required=True, help="image folder with train/<class>/ and test/<class>/ (or validation/)")
    p.add_argument("--out", required=True, help="directory for the TFRecord files (created)")
    p.add_argument("--shards", type=int, default=8, help="training files (the test split gets a quarter, at least 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the order of examples across and within files")
    a = p.parse_args(argv)
    import tensorflow as tf

    from hvdtrain.data.folder import TEST_SPLITS, list_split

    try:
        if a.shards < 1:
            raise HvdtrainError(f"--shards must be >= 1, got {a.shards}")
        train_paths, train_labels, names = list_split(os.path.join(a.folder, "train"))
        test = next((s for s in TEST_SPLITS if os.path.isdir(os.path.join(a.folder, s))), None)
        if test is None:
            raise HvdtrainError(f"{a.folder}: no test/ or validation/ folder")
        test_paths, test_labels, _ = list_split(os.path.join(a.folder, test), names)
        os.makedirs(a.out, exist_ok=True)
        stale = sorted(n for n in os.listdir(a.out) if n.split("-")[0] in ("train", *TEST_SPLITS))
        if stale:  # shards of an earlier conversion would be read as data too
            raise HvdtrainError(f"--out {a.out} already holds TFRecord files ({stale[0]}...): choose an empty directory")
        n_train = write_split(train_paths, train_labels, names, a.out, "train", a.shards, a.seed)
        n_test = write_split(test_paths, test_labels, names, a.out, test, max(1, a.shards // 4), a.seed + 1)
    except (HvdtrainError, OSError, tf.errors.OpError) as e:
        say(f"make_tfrecords: error: {e}", sys.stderr)
        return 2
    say(f"make_tfrecords: {n_train:,} training and {n_test:,} {test} examples of {len(names)} classes in {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
