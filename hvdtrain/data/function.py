"""Your own tf.data pipeline: ``--data package.module:function``.

The function is called as::

    function(split="train" | "test", rank=r, world_size=R, seed=s, epoch=e) -> tf.data.Dataset

and returns the whole split as *unbatched* ``(image, label)`` pairs: image ``(H, W, C)`` of a
static shape, uint8 pixels (scaled to [0, 1] by hvdtrain) or float32 (passed to the model as
they are); label an integer class index in ``[0, K)``, a scalar, or a map of one per pixel of a
static shape ``(H', W')`` (segmentation). It must give the same examples in the same
order on every rank for the same ``(seed, epoch)`` -- shuffle with ``seed`` and ``epoch``, not
unseeded -- and the same number every epoch. hvdtrain takes this rank's contiguous part of the
stream (``skip``/``take``: a rank, and a resumed epoch, reads through the examples before its
part, so keep costly work where skipping is cheap -- decode after ``skip`` is not possible here,
decode in a ``map`` the skipped elements still pass through), batches it to the plan's local
batch sizes and prefetches; ``rank`` and
``world_size`` are for information (say, a per-rank cache path). Augment inside the function.

The split's size is the dataset's ``cardinality()`` where tf.data knows it, else one pass counts
it; the class count is ``--num-classes`` or, if 0, one pass over the training labels infers it.
"""
from __future__ import annotations

import hashlib
from typing import Callable, Optional, Union

import numpy as np
import tensorflow as tf

from hvdtrain.data.sharding import ShardPlan, eval_shard
from hvdtrain.data.stream import (ImageView, Split, StreamingDataset, local_sizes, rank_range, tf_message,
                                  untuned)
from hvdtrain.errors import HvdtrainError
from hvdtrain.user_code import import_function, name_of


class FunctionSplit(Split):
    """One split of a data function; see the module.

    Args:
        fn: the user's function.
        where: what messages call it: ``--data package.module:function``, or how it was given.
        split: ``"train"`` or ``"test"``.
        rank, world_size, seed: passed on to it.
        num_examples: the split's size.
        image_dtype: its images' dtype (uint8 or floating point).
    """

    decodes = False

    def __init__(self, fn: Callable, where: str, split: str, rank: int, world_size: int, seed: int,
                 num_examples: int, image_dtype: tf.DType):
        self.fn, self.where, self.split = fn, where, split
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.num_examples, self.image_dtype = num_examples, image_dtype

    def call(self, epoch: int) -> tf.data.Dataset:
        """The function's dataset for ``epoch``, its structure checked.

        Raises:
            HvdtrainError: if the function raises, or returns no ``tf.data.Dataset`` of
                ``(image, label)`` as the module describes.
        """
        try:
            data = self.fn(split=self.split, rank=self.rank, world_size=self.world_size, seed=self.seed, epoch=epoch)
        except Exception as e:  # noqa: BLE001 -- the user's code: any error becomes one clear message
            raise HvdtrainError(f"{self.where}: the function raised {type(e).__name__}: {e} "
                                f"(split {self.split!r}, epoch {epoch})") from None
        check_structure(data, self.where, self.split)
        return data  # labels keep their dtype until the range check (a uint64 cast to int32 could wrap)

    def _positioned(self, data: tf.data.Dataset, first: int, count: int) -> tf.data.Dataset:
        part = data.skip(first).take(count)
        return tf.data.Dataset.zip((part, tf.data.Dataset.range(first, first + count))).map(
            lambda example, key: (*example, key))

    def rank_elements(self, plan: ShardPlan, epoch: int, first_step: int, first_example: int = 0, threads: int = 1):
        first, count = rank_range(plan, first_step, first_example)
        sizes = local_sizes(plan, plan.rank)
        done = sum(sizes[:first_step])
        return self._positioned(self.call(epoch), first + done, count - done), sizes[first_step:]

    def eval_elements(self, world_size: int, rank: int):
        part = eval_shard(self.num_examples, world_size, rank)
        return self._positioned(self.call(0), part.start, part.stop - part.start)

    def origin(self, image, label, key) -> str:
        return f"{self.where}: example {int(key)} (0-based) of split {self.split!r}"


def check_structure(data, where: str, split: str) -> None:
    """Refuse what is not a dataset of unbatched ``(image (H, W, C), integer label)`` pairs.

    Raises:
        HvdtrainError: saying what the function returned instead.
    """
    where = f"{where} (split {split!r})"
    if not isinstance(data, tf.data.Dataset):
        raise HvdtrainError(f"{where}: the function must return a tf.data.Dataset, got {type(data).__name__}")
    spec_ = data.element_spec
    if not isinstance(spec_, tuple) or len(spec_) != 2 or not all(isinstance(s, tf.TensorSpec) for s in spec_):
        raise HvdtrainError(f"{where}: the dataset's elements must be (image, label) pairs of tensors, got {spec_}")
    image, label = spec_
    if image.shape.rank == 4:
        raise HvdtrainError(f"{where}: the dataset is batched (images {image.shape}); return unbatched examples "
                            f"(hvdtrain batches them to the plan's local batch sizes)")
    if image.shape.rank != 3 or not image.shape.is_fully_defined():
        raise HvdtrainError(f"{where}: images must have a static shape (H, W, C), got {image.shape} (resize in the "
                            f"function, or set it with tf.ensure_shape)")
    if image.dtype != tf.uint8 and not image.dtype.is_floating:
        raise HvdtrainError(f"{where}: images must be uint8 or floating point, got {image.dtype.name}")
    if not label.dtype.is_integer or not label.shape.is_fully_defined():
        raise HvdtrainError(f"{where}: labels must be integer class indices (scalars, or maps of a static shape), got "
                            f"{label.dtype.name} of shape {label.shape}")


def _count_and_labels(data: tf.data.Dataset, need_labels: bool):
    """``(count, labels or None)`` of a dataset, by one pass where tf.data does not know its size.

    Raises:
        HvdtrainError: for an infinite dataset (``.repeat()``), whose pass would never end.
    """
    if data.cardinality() == tf.data.INFINITE_CARDINALITY:
        raise HvdtrainError("the dataset is infinite (.repeat()?): return one pass of the split; hvdtrain makes "
                            "the epochs")
    if not need_labels and data.cardinality() >= 0:
        return int(data.cardinality()), None
    labels = [batch.numpy() for batch in untuned(data.map(lambda image, label: label).batch(4096))]
    labels = np.concatenate(labels) if labels else np.zeros(0, np.int32)
    return len(labels), labels


def open_function(spec: Union[str, Callable], rank: int, world_size: int, seed: int, num_classes: int, check_labels,
                  where: Optional[str] = None) -> StreamingDataset:
    """Open the user's data function ``spec`` as a :class:`StreamingDataset`.

    Calls it for each split at epoch 0 and reads each through once where its size (or, without
    ``num_classes``, its labels) is not known otherwise. The labels read, in their order, enter
    the data's fingerprint, which every rank compares with rank 0's: a rank whose dataset gives
    another order at epoch 0 (an unseeded shuffle, ``Dataset.list_files``) is refused.

    Args:
        spec: ``package.module:function`` (``--data``), or the function itself (``hvdtrain.fit(data=fn)``).
        rank, world_size, seed: passed on to the function.
        num_classes: the class count; 0 infers it from the training labels.
        check_labels: :func:`hvdtrain.data.in_memory.check_labels`.
        where: what messages call the data (default ``--data <spec>``).

    Raises:
        HvdtrainError: for a function that cannot be imported, raises, returns the wrong
            structure, splits whose image shapes differ, or labels out of range.
    """
    fn = spec if callable(spec) else import_function(spec, "--data")
    spec = name_of(spec)
    name = where or f"data:{spec}"
    where = where or f"--data {spec}"
    splits, labels = {}, {}
    for split in ("train", "test"):
        probe = FunctionSplit(fn, where, split, rank, world_size, seed, 0, tf.uint8)
        data = probe.call(0)
        try:
            count, labels[split] = _count_and_labels(data, need_labels=not num_classes)
        except HvdtrainError as e:
            raise HvdtrainError(f"{where} (split {split!r}): {e}") from None
        except tf.errors.OpError as e:
            raise HvdtrainError(f"{where}: reading split {split!r} failed: {tf_message(e)}") from None
        image, label = data.element_spec
        splits[split] = FunctionSplit(fn, where, split, rank, world_size, seed, count, image.dtype)
        splits[split].shape = tuple(image.shape.as_list())
        splits[split].label_shape = tuple(label.shape.as_list())
    train, test = splits["train"], splits["test"]
    if train.shape != test.shape or train.image_dtype != test.image_dtype:
        raise HvdtrainError(f"{where}: train images are {train.image_dtype.name} {train.shape}, test images "
                            f"{test.image_dtype.name} {test.shape}; they must be alike")
    if train.label_shape != test.label_shape:
        raise HvdtrainError(f"{where}: train labels are of shape {train.label_shape}, test labels "
                            f"{test.label_shape}; they must be alike")
    if num_classes:
        if not train.num_examples or not test.num_examples:
            raise HvdtrainError(f"{name}: empty split ({train.num_examples} training, {test.num_examples} test examples)")
    else:
        num_classes = check_labels(name, labels["train"], labels["test"], 0)
    digest = hashlib.blake2b(f"{spec}:{train.shape}:{train.image_dtype.name}".encode(), digest_size=16)
    for split in ("train", "test"):  # the labels in the order read: ranks that read another order differ here
        if labels[split] is not None:
            digest.update(np.ascontiguousarray(labels[split]).tobytes())
    view = ImageView(0, "none", train.shape)
    opened = StreamingDataset(name, train, test, num_classes, view, seed, {"digest": digest.hexdigest()})
    opened.label_shape = train.label_shape
    return opened


def datasets_function(train: tf.data.Dataset, test: tf.data.Dataset, shuffle_buffer: int) -> Callable:
    """A data function (see the module) over two datasets of unbatched ``(image, label)`` pairs,
    the same on every rank: ``hvdtrain.fit(data=(train, test))``.

    Each epoch shuffles the training examples in a buffer of ``shuffle_buffer`` with a seed of
    ``(seed, epoch)``, so every rank sees the same order and takes its own part of it; the test
    examples keep their order.

    Raises:
        HvdtrainError: (when called) for anything but two ``tf.data.Dataset`` objects.
    """
    for split, data in (("train", train), ("test", test)):
        if not isinstance(data, tf.data.Dataset):
            raise HvdtrainError(f"hvdtrain.fit(data=(train, test)): the {split} set must be a tf.data.Dataset, got "
                                f"{type(data).__name__}")

    def tf_data(split, rank, world_size, seed, epoch):
        if split == "test":
            return test
        # One seed per (seed, epoch), alike on every rank: tf.data's shuffle is then the same order everywhere.
        return train.shuffle(shuffle_buffer, seed=seed * 1_000_003 + epoch, reshuffle_each_iteration=False)

    return tf_data
