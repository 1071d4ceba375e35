"""TFRecord shards: ``DIR/train-*`` and ``DIR/test-*`` (or ``validation-*``) of ``tf.train.Example``
records with the encoded image (``image/encoded``, JPEG or PNG bytes) and its int64 class
(``image/class/label``), as the ImageNet TFRecord convention writes them
(:mod:`hvdtrain.tools.make_tfrecords` writes them from an image folder).

How each rank gets the same number of records, every record once: the first run reads every
record once (on rank 0) to count each file's records and check every record's keys and label,
and caches that index beside the data (``hvdtrain-index.json``; rebuilt when a file's size or
modification time changes, and not cached where the folder is read-only). Each epoch the files
are read in an order shuffled by ``(seed, epoch)``; that stream of ``n`` records is cut into one
contiguous range per rank, each as long as the rank's local batches of the
:class:`~hvdtrain.data.sharding.ShardPlan` add up to (sizes differ by at most one batch's rounding;
a range may begin or end inside a file, so there may be more ranks than files). A rank reads
only its range: :data:`FILES_AT_ONCE` files interleaved (read by up to that many threads, one per
core of the rank, in one order), then a shuffle buffer seeded by ``(seed, epoch, rank)``; each
record is parsed where it is decoded. Evaluation reads the files in order, one at a time.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
from typing import Dict, List, Tuple

import numpy as np
import tensorflow as tf

from hvdtrain.data.sharding import ShardPlan, eval_shard
from hvdtrain.data.stream import (ImageView, Split, StreamingDataset, contiguous_segments, local_sizes, rank_range,
                                  stored_shape, tf_message, untuned)
from hvdtrain.errors import HvdtrainError
from hvdtrain.files import replace_file

INDEX_FILE = "hvdtrain-index.json"
INDEX_VERSION = 1
TEST_PREFIXES = ("test", "validation")
SCAN_BATCH = 1024  # records parsed at once while indexing
FILES_AT_ONCE = 4  # a rank's training files interleaved record by record, before the shuffle buffer


def _features(image_key: str, label_key: str) -> dict:
    return {image_key: tf.io.FixedLenFeature([], tf.string), label_key: tf.io.FixedLenFeature([], tf.int64)}


class TFRecordSplit(Split):
    """One split's files (sorted paths) and record counts; see the module for how ranks read it.

    Args:
        files: paths, sorted.
        counts: records per file.
        image_key, label_key: the features read from each record.
        shuffle_buffer: records in each rank's shuffle buffer (training).
        seed: the run's seed.
    """

    def __init__(self, files: List[str], counts: List[int], image_key: str, label_key: str, shuffle_buffer: int,
                 seed: int):
        self.files, self.counts = list(files), [int(c) for c in counts]
        self.features = _features(image_key, label_key)
        self.image_key, self.label_key = image_key, label_key
        self.shuffle_buffer, self.seed = shuffle_buffer, seed
        self.num_examples = sum(self.counts)

    def _read(self, segments: List[Tuple[int, int, int]], files_at_once: int, threads: int) -> tf.data.Dataset:
        """The records of ``(file, skip, take)`` segments as ``(serialized, key)``, key =
        file << 32 | record number; ``files_at_once`` files interleaved record by record, read by
        up to ``threads`` threads in that same order."""
        if not segments:
            return tf.data.Dataset.from_tensor_slices((tf.zeros([0], tf.string), tf.zeros([0], tf.int64)))
        f, skip, take = (np.array(column, np.int64) for column in zip(*segments))
        paths = np.array(self.files)[f]

        def records(path, file, first, count):
            key = tf.bitwise.left_shift(file, 32) + first  # a range, not a map: a map per record cost 8x the read
            return tf.data.Dataset.zip((tf.data.TFRecordDataset(path).skip(first).take(count),
                                        tf.data.Dataset.range(key, key + count)))

        # One core: one reader (input_pipeline.py); more fill the shuffle buffer sooner (imagenet_input.py).
        cycle = max(1, min(files_at_once, len(segments)))
        readers = min(threads, cycle)
        parallel = {"num_parallel_calls": readers, "deterministic": True} if readers > 1 else {}
        return tf.data.Dataset.from_tensor_slices((paths, f, skip, take)).interleave(
            records, cycle_length=cycle, block_length=1, **parallel)

    def file_order(self, epoch: int) -> np.ndarray:
        """The epoch's file order, a function of ``(seed, epoch)`` only."""
        return np.random.default_rng([self.seed, epoch, 0x7F]).permutation(len(self.files))

    def rank_elements(self, plan: ShardPlan, epoch: int, first_step: int, first_example: int = 0, threads: int = 1):
        first, count = rank_range(plan, first_step, first_example)
        records = self._read(contiguous_segments(self.counts, self.file_order(epoch), first, count),
                             files_at_once=FILES_AT_ONCE, threads=threads)
        if plan.shuffle:
            seed = int(np.random.SeedSequence([self.seed, epoch, plan.rank]).generate_state(1)[0])
            records = records.shuffle(self.shuffle_buffer, seed=seed, reshuffle_each_iteration=False)
        sizes = local_sizes(plan, plan.rank)
        return records.skip(sum(sizes[:first_step])), sizes[first_step:]

    def eval_elements(self, world_size: int, rank: int):
        part = eval_shard(self.num_examples, world_size, rank)  # in the files' order, one file at a time
        return self._read(contiguous_segments(self.counts, range(len(self.files)), part.start, part.stop - part.start),
                          files_at_once=1, threads=1)

    def load(self, serialized, key):
        """``(serialized, key)`` -> ``(encoded image, label, key)``: each record parsed on the
        rank's decoding threads (a serial parse held decoding back until it had read 1,024 records)."""
        parsed = tf.io.parse_single_example(serialized, self.features)
        return parsed[self.image_key], parsed[self.label_key], key

    def origin(self, serialized, key) -> str:
        key = int(key)
        return f"{self.files[key >> 32]}: record {(key & 0xFFFFFFFF) + 1} (1-based)"


# ---- the index ---------------------------------------------------------------------------------------
def find_files(data_dir: str) -> Tuple[List[str], List[str]]:
    """``(train files, test files)``, sorted.

    Raises:
        HvdtrainError: for a missing directory, or no ``train-*`` or no ``test-*``/``validation-*`` files.
    """
    if not os.path.isdir(data_dir):
        raise HvdtrainError(f"--data-dir {data_dir} is not a directory (--dataset tfrecord reads "
                            f"<data-dir>/train-* and <data-dir>/test-* TFRecord files)")
    train = sorted(p for p in glob.glob(os.path.join(data_dir, "train-*")) if os.path.isfile(p))
    test = []
    for prefix in TEST_PREFIXES:
        test = test or sorted(p for p in glob.glob(os.path.join(data_dir, f"{prefix}-*")) if os.path.isfile(p))
    if not train or not test:
        raise HvdtrainError(f"{data_dir}: no {'train-*' if not train else 'test-* or validation-*'} TFRecord files")
    return train, test


def _stat(path: str) -> dict:
    st = os.stat(path)
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def scan_file(path: str, image_key: str, label_key: str) -> dict:
    """Read every record of one file: its count and label histogram, and check the keys.

    Returns:
        ``{"records": n, "labels": {label: count}, "bytes", "mtime_ns"}`` (labels as str keys, for JSON).

    Raises:
        HvdtrainError: naming the file (and the record) for a truncated or corrupt file, or a
            record without the image or label key, or whose values have the wrong type.
    """
    features = _features(image_key, label_key)
    labels = []
    try:
        batches = untuned(tf.data.TFRecordDataset(path).batch(SCAN_BATCH).map(
            lambda serialized: tf.io.parse_example(serialized, features)[label_key]))
        for batch in batches:
            labels.append(batch.numpy())
    except tf.errors.OpError:
        _find_bad_record(path, features, done=sum(len(b) for b in labels))
        raise
    labels = np.concatenate(labels) if labels else np.zeros(0, np.int64)
    values, counts = np.unique(labels, return_counts=True)
    return {"records": int(len(labels)), "labels": {str(v): int(c) for v, c in zip(values, counts)}, **_stat(path)}


def _find_bad_record(path: str, features: dict, done: int) -> None:
    """Raise the error naming the first bad record at or after record ``done`` of ``path``."""
    record = done
    try:
        for serialized in tf.data.TFRecordDataset(path).skip(done):
            try:
                tf.io.parse_single_example(serialized, features)
            except (tf.errors.OpError, ValueError) as e:
                raise HvdtrainError(f"{path}: record {record + 1} (1-based): {tf_message(e)} (keys: "
                                    f"--tfrecord-image-key {list(features)[0]}, --tfrecord-label-key "
                                    f"{list(features)[1]})") from None
            record += 1
    except (tf.errors.NotFoundError, tf.errors.PermissionDeniedError) as e:
        raise HvdtrainError(f"{path}: cannot read it ({tf_message(e)})") from None
    except tf.errors.OpError as e:
        raise HvdtrainError(f"{path}: record {record + 1} (1-based) is truncated or corrupt, after {record} good "
                            f"record(s) ({tf_message(e)})") from None
    raise HvdtrainError(f"{path}: cannot be read (TFRecord)")


def load_index(data_dir: str, files: List[str], image_key: str, label_key: str) -> Tuple[Dict[str, dict], bool]:
    """Each file's :func:`scan_file` entry: from the cache beside the data where it is current,
    else scanned.

    Returns:
        ``({file name: entry} for files, whether any entry was scanned)``: :func:`save_index`
        caches a scanned index once the data has passed every check.

    Raises:
        HvdtrainError: from :func:`scan_file`, for a bad file.
    """
    cached = {}
    try:
        with open(os.path.join(data_dir, INDEX_FILE)) as f:
            cache = json.load(f)
        if cache.get("version") == INDEX_VERSION and cache.get("keys") == [image_key, label_key]:
            cached = cache.get("files", {})
    except (OSError, ValueError):
        pass
    index, scanned = {}, False
    for path in files:
        name = os.path.basename(path)
        entry = cached.get(name)
        if not entry or any(entry.get(k) != v for k, v in _stat(path).items()):
            entry, scanned = scan_file(path, image_key, label_key), True
        index[name] = entry
    return index, scanned


def save_index(data_dir: str, index: Dict[str, dict], image_key: str, label_key: str) -> bool:
    """Cache ``index`` beside the data (atomically), where the folder is writable.

    Returns:
        Whether it was written.
    """
    if not os.access(data_dir, os.W_OK):
        return False
    text = json.dumps({"version": INDEX_VERSION, "keys": [image_key, label_key], "files": index})
    try:
        replace_file(os.path.join(data_dir, INDEX_FILE), text)
    except OSError:
        return False
    return True


def check_local_files(files: List[str], index: Dict[str, dict]) -> None:
    """Check that this host's files are the indexed ones (rank 0's): the same sizes.

    Raises:
        HvdtrainError: naming a file that differs.
    """
    for path in files:
        entry = index.get(os.path.basename(path))
        size = os.path.getsize(path)
        if entry is None or entry["bytes"] != size:
            raise HvdtrainError(f"{path}: {size} bytes on this host, but rank 0 indexed "
                                f"{'no such file' if entry is None else str(entry['bytes']) + ' bytes'}; every host "
                                f"must hold the same TFRecord files")


def label_histogram(files: List[str], index: Dict[str, dict]) -> Dict[int, int]:
    """``{label: records}`` over ``files``, from their index entries."""
    total: Dict[int, int] = {}
    for path in files:
        for label, count in index[os.path.basename(path)]["labels"].items():
            total[int(label)] = total.get(int(label), 0) + count
    return total


def first_image_shape(path: str, image_key: str) -> Tuple[int, int, int]:
    """``(H, W, C)`` of the first record's image, C forced to 1 or 3.

    Raises:
        HvdtrainError: if the file has no record, or its first image cannot be decoded.
    """
    for serialized in tf.data.TFRecordDataset(path).take(1):
        encoded = tf.io.parse_single_example(serialized, {image_key: tf.io.FixedLenFeature([], tf.string)})[image_key]
        return stored_shape(encoded, f"{path}: record 0's image")
    raise HvdtrainError(f"{path}: no records")


def open_tfrecords(data_dir: str, index: Dict[str, dict], image_key: str, label_key: str, num_classes: int,
                   image_size: int, augment: str, shuffle_buffer: int, seed: int, check_labels) -> StreamingDataset:
    """Open TFRecord shards whose ``index`` (:func:`load_index`, rank 0's) is known.

    Args:
        data_dir: the directory of ``train-*`` and ``test-*`` files.
        index: rank 0's index of them.
        image_key, label_key: the features read.
        num_classes: the class count; 0 infers it from the labels.
        image_size, augment: the :class:`ImageView`'s.
        shuffle_buffer: records in each rank's shuffle buffer.
        seed: the run's seed.
        check_labels: ``(name, train_labels, test_labels, num_classes) -> num_classes``
            (:func:`hvdtrain.data.in_memory.check_labels`), on the labels' histograms expanded.

    Raises:
        HvdtrainError: for files that differ from the index, an empty split, labels out of range.
    """
    train, test = find_files(data_dir)
    check_local_files(train + test, index)
    name = f"tfrecord:{data_dir}"
    hist = [label_histogram(files, index) for files in (train, test)]
    expanded = [np.repeat(np.array(list(h), np.int64), list(h.values())) for h in hist]
    num_classes = check_labels(name, *expanded, num_classes)
    first = next((p for p in train if index[os.path.basename(p)]["records"]), train[0])
    view = ImageView(image_size, augment, first_image_shape(first, image_key))
    digest = hashlib.blake2b(digest_size=16)
    for path in train + test:
        entry = index[os.path.basename(path)]
        digest.update(f"{os.path.basename(path)}:{entry['bytes']}:{entry['records']};".encode())

    def split(files):
        return TFRecordSplit(files, [index[os.path.basename(p)]["records"] for p in files], image_key, label_key,
                             shuffle_buffer, seed)

    # The shuffle buffer is part of each epoch's stream: a resume with another would repeat some records.
    return StreamingDataset(name, split(train), split(test), num_classes, view, seed,
                            {"digest": digest.hexdigest(), "shuffle_buffer": shuffle_buffer})
