"""Image folders: ``DIR/train/<class>/*.jpg|png`` and ``DIR/test/<class>/...`` (or ``validation/``),
streamed by tf.data.

Classes are the training split's sub-folders, sorted by name, as Keras'
``image_dataset_from_directory`` orders them; examples are the files of each class, sorted. Each
step a rank reads exactly the examples the :class:`~hvdtrain.data.sharding.ShardPlan` gives it
(the same as in memory): one process at the global batch reads the same examples at each step,
and an elastic job that changes world size continues at the same example of the epoch.
"""
from __future__ import annotations

import hashlib
import os
from typing import List, Tuple

import numpy as np
import tensorflow as tf

from hvdtrain.data import images
from hvdtrain.data.sharding import ShardPlan, eval_shard
from hvdtrain.data.stream import ImageView, Split, StreamingDataset, stored_shape
from hvdtrain.errors import HvdtrainError

TEST_SPLITS = ("test", "validation")


class FolderSplit(Split):
    """The files of one split: ``paths`` (bytes) and ``labels`` (int32), in the split's order."""

    def __init__(self, paths: np.ndarray, labels: np.ndarray):
        self.paths, self.labels = paths, labels
        self.num_examples = len(paths)

    def _elements(self, indices: np.ndarray) -> tf.data.Dataset:
        indices = np.asarray(indices, np.int64)
        return tf.data.Dataset.from_tensor_slices((self.paths[indices], self.labels[indices], indices))

    def rank_elements(self, plan: ShardPlan, epoch: int, first_step: int, first_example: int = 0, threads: int = 1):
        sizes, parts = [], []
        for _, local, _ in plan.epoch(epoch, first_step, first_example):
            sizes.append(len(local))
            parts.append(local)
        return self._elements(np.concatenate(parts) if parts else np.zeros(0, np.int64)), sizes

    def eval_elements(self, world_size: int, rank: int):
        return self._elements(np.arange(self.num_examples)[eval_shard(self.num_examples, world_size, rank)])

    def load(self, path, label, index):
        return tf.io.read_file(path), label, index

    def origin(self, path, label, index) -> str:
        return f"image {path.numpy().decode()}"


def list_split(split_dir: str, class_names: List[str] = None) -> Tuple[np.ndarray, np.ndarray, List[str]]:
    """The image files under ``split_dir/<class>/`` and their labels.

    Args:
        split_dir: one split's folder.
        class_names: the classes (the training split's); None takes this folder's sub-folders.

    Returns:
        ``(paths, labels, class_names)``: bytes ``(n,)``, int32 ``(n,)``, sorted class names.

    Raises:
        HvdtrainError: for a missing folder, no class sub-folder, a class folder without images,
            or (given ``class_names``) a class the training split does not have.
    """
    if not os.path.isdir(split_dir):
        raise HvdtrainError(f"image folder {split_dir} does not exist (--dataset folder reads "
                            f"<data-dir>/train/<class>/*.jpg and <data-dir>/test/<class>/...)")
    found = sorted(e.name for e in os.scandir(split_dir) if e.is_dir())
    if not found:
        raise HvdtrainError(f"{split_dir}: no class folders (--dataset folder reads {split_dir}/<class>/*.jpg|png)")
    names = class_names if class_names is not None else found
    unknown = sorted(set(found) - set(names))
    if unknown:
        raise HvdtrainError(f"{split_dir}: class folder(s) {unknown[:5]} are not among the training split's "
                            f"{len(names)} classes")
    paths, labels = [], []
    for name in found:
        folder = os.path.join(split_dir, name)
        files = sorted(e.name for e in os.scandir(folder)
                       if e.is_file() and os.path.splitext(e.name)[1].lower() in images.IMAGE_EXTENSIONS)
        if not files:
            raise HvdtrainError(f"class folder {folder} holds no images ({', '.join(images.IMAGE_EXTENSIONS)})")
        paths += [os.path.join(folder, f) for f in files]
        labels += [names.index(name)] * len(files)
    # Bytes, not str: numpy stores str at 4 bytes a character, which for a million paths is a
    # quarter of a GiB on every rank.
    return np.array([os.fsencode(p) for p in paths]), np.array(labels, np.int32), names


def first_image_shape(path: str) -> Tuple[int, int, int]:
    """``(H, W, C)`` of one image file, C forced to 1 (grayscale) or 3.

    Raises:
        HvdtrainError: naming the file if it is no readable image.
    """
    return stored_shape(tf.io.read_file(path), f"image {path}")


def open_folder(data_dir: str, image_size: int, augment: str, seed: int) -> StreamingDataset:
    """Open ``data_dir`` as an image folder dataset (nothing is decoded but the first image).

    Args:
        data_dir: holds ``train/<class>/`` and ``test/<class>/`` (or ``validation/``).
        image_size, augment: the :class:`ImageView`'s.
        seed: the run's seed (augmentation).

    Raises:
        HvdtrainError: see :func:`list_split`; also for a missing test split or an unreadable
            first image.
    """
    if not os.path.isdir(data_dir):
        raise HvdtrainError(f"--data-dir {data_dir} is not a directory (--dataset folder reads "
                            f"<data-dir>/train/<class>/*.jpg and <data-dir>/test/<class>/...)")
    train_paths, train_labels, names = list_split(os.path.join(data_dir, "train"))
    test_dir = next((os.path.join(data_dir, s) for s in TEST_SPLITS if os.path.isdir(os.path.join(data_dir, s))), None)
    if test_dir is None:
        raise HvdtrainError(f"{data_dir}: no test split (a folder test/ or validation/ with the class folders)")
    test_paths, test_labels, _ = list_split(test_dir, names)
    if len(names) < 2:
        raise HvdtrainError(f"{data_dir}/train: need at least 2 class folders, found {names}")
    view = ImageView(image_size, augment, first_image_shape(os.fsdecode(train_paths[0])))
    digest = hashlib.blake2b(digest_size=16)
    for path in (*train_paths, *test_paths):
        digest.update(os.path.relpath(path, os.fsencode(data_dir)) + b"\0")
    return StreamingDataset(f"folder:{data_dir}", FolderSplit(train_paths, train_labels),
                            FolderSplit(test_paths, test_labels), len(names), view, seed,
                            {"digest": digest.hexdigest()})
