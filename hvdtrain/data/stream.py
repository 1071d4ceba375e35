"""Streaming datasets: examples read from files by tf.data while training runs, never held whole.

A :class:`StreamingDataset` pairs a training and a test :class:`Split` (an image folder, TFRecord
shards, or the user's own ``tf.data`` function) with how images become the model's input
(:class:`ImageView`). Each epoch it builds this rank's pipeline:

    this rank's elements, in its order (the split's)  ->  load (read a file, parse a record), decode,
    crop, augment (one thread per core of the rank, deterministic)  ->  local batches of the plan's
    sizes  ->  prefetch (:data:`PREFETCH_BATCHES`)

and the training loop iterates it with its threads behind the step's (:func:`behind_the_step`).

The local batch sizes are the :class:`~hvdtrain.data.sharding.ShardPlan`'s, so every rank runs
the same steps, each global batch holds the same number of examples as in memory, and every
example of an epoch is read by exactly one rank. Which examples a rank reads is the split's
(:meth:`Split.rank_elements`): an image folder reads the plan's own indices (the in-memory order,
exactly); TFRecord shards and a data function read one contiguous range of the epoch's stream per
rank.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Iterator, List, Sequence, Tuple

import tensorflow as tf

from hvdtrain.config import CLASSES
from hvdtrain.data import images
from hvdtrain.data.sharding import ShardPlan
from hvdtrain.errors import HvdtrainError
from hvdtrain.runtime.priority import call_at_nice


# Batches decoded ahead of the step: enough to hide the next batch's decoding behind the step, and
# a fixed memory cost (AUTOTUNE's buffers grow up to a share of the host's RAM).
PREFETCH_BATCHES = 2
# The pipeline's threads' nice value: on a rank's busy cores they decode while the step waits (for
# an allreduce, for its device) instead of delaying it, which delays every rank; on idle cores
# (a GPU's host) they run as fast as at any priority.
PIPELINE_NICE = 19


@dataclasses.dataclass(frozen=True)
class ImageView:
    """How stored images become the model's input.

    Attributes:
        image_size: side of the square the model sees (resized); 0 keeps the stored size.
        augment: ``none``, ``flip`` or ``standard`` (:func:`hvdtrain.data.images.preprocess`).
        stored_shape: ``(H, W, C)`` of the first training image: every image's, when
            ``image_size`` is 0; its ``C`` is every image's channel count.
    """

    image_size: int
    augment: str
    stored_shape: Tuple[int, int, int]

    @property
    def channels(self) -> int:
        """Channels every image is decoded to (1 or 3; a data function's own)."""
        return self.stored_shape[2]

    @property
    def input_shape(self) -> Tuple[int, int, int]:
        """``(H, W, C)`` of the model's input."""
        if self.image_size:
            return (self.image_size, self.image_size, self.channels)
        return tuple(self.stored_shape)


class Split:
    """One split of a streaming dataset: its size and this rank's elements.

    An element is a tuple that :meth:`load` makes an image (encoded bytes, or uint8 or float
    ``(H, W, C)``) and an integer label of; its last item is a unique int64 key, which seeds its
    augmentation and names it in errors (:meth:`origin`).
    """

    num_examples: int
    decodes = True  # False: the elements already hold images (a data function's)

    def rank_elements(self, plan: ShardPlan, epoch: int, first_step: int, first_example: int = 0,
                      threads: int = 1) -> Tuple[tf.data.Dataset, List[int]]:
        """This rank's elements from ``plan.start_step(first_step, first_example)`` to the end of
        ``epoch``, in its order, and its local batch size at each of those steps (the plan's).
        ``threads``: the threads the rank's pipeline may read with (the order is the same for any).

        Raises:
            ValueError: for a ``first_example`` past ``first_step``'s first example where the
                split reads one range per rank (:func:`rank_range`).
        """
        raise NotImplementedError

    def eval_elements(self, world_size: int, rank: int) -> tf.data.Dataset:
        """This rank's part of the split for evaluation (:func:`eval_shard`'s, each example once)."""
        raise NotImplementedError

    def load(self, *element: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """One element -> ``(image, label, key)``: the encoded image (bytes) when :attr:`decodes`,
        else the image. Runs in the parallel decoding map, so that reading (a file, a record's
        parse) is spread over the rank's cores, as decoding is."""
        return element

    def origin(self, *element) -> str:
        """Where an element comes from, for an error message (eager)."""
        raise NotImplementedError


def rank_threads(threads: int = 0) -> int:
    """``threads``, or where 0, one per CPU this process may run on."""
    return threads or len(os.sched_getaffinity(0))


def untuned(data: tf.data.Dataset, threads: int = 0) -> tf.data.Dataset:
    """``data`` run by a private pool of ``threads`` threads (0: one per CPU this process may run
    on), without tf.data's autotuning.

    Closing an iterator waits for the autotuning thread's next wake-up, up to 10 s away once a
    pipeline has run a while: on TF 2.21 every epoch's end stalled for up to that long. With a
    rank's cores known there is little to tune; stages given ``AUTOTUNE`` (a data function's) run
    at tf.data's starting value instead, bounded by the pool.
    """
    options = tf.data.Options()
    options.threading.private_threadpool_size = rank_threads(threads)
    options.autotune.enabled = False
    return data.with_options(options)


def behind_the_step(data: tf.data.Dataset, nice: int = PIPELINE_NICE) -> Iterator:
    """Iterate ``data`` with its pipeline's threads at nice ``nice``, the calling thread (the
    step's) at its own.

    tf.data starts a pipeline's threads (its private pool, the parallel map's and prefetch's) when
    the iterator is made and its first element asked for; both happen in a thread at ``nice``
    (:func:`hvdtrain.runtime.priority.call_at_nice`), which they inherit. Threads the pipeline
    starts later are started by those, behind a ``prefetch`` at its top (this module's pipelines).

    Args:
        data: the pipeline.
        nice: 0 (the step's priority) to 19 (:data:`PIPELINE_NICE`, the lowest).

    Yields:
        ``data``'s elements, in order.

    Raises:
        tf.errors.OpError: as iterating ``data`` would.
    """
    end = object()

    def start():
        iterator = iter(data)
        return iterator, next(iterator, end)

    iterator, first = call_at_nice(nice, start)
    if first is not end:
        yield first
        yield from iterator


def local_sizes(plan: ShardPlan, rank: int) -> List[int]:
    """``rank``'s local batch size at every step of an epoch (ints, ``plan.steps_per_epoch``)."""
    sizes = []
    for step in range(plan.steps_per_epoch):
        local = plan.local_slice(step, rank)
        sizes.append(local.stop - local.start)
    return sizes


def rank_range(plan: ShardPlan, first_step: int = 0, first_example: int = 0) -> Tuple[int, int]:
    """``(first, count)``: the contiguous range of an epoch's stream of ``plan.num_examples`` that
    this rank reads, when whole ranges are the unit: ranks in order, each as many examples as
    the plan's local batches add up to.

    Such a split resumes at a step of the plan its ranges were cut for (``first_step``): ranks of
    another world size read other ranges, so an example of their epoch (an elastic job's position,
    ``first_example``) means nothing in it. A position inside a step is refused here; one on a
    step's start cannot be told from a step of this plan, which is why the config refuses
    ``--elastic`` with these splits.

    Raises:
        ValueError: for a ``first_example`` past ``first_step``'s first example.
    """
    if first_example > plan.examples_before(first_step):
        raise ValueError(f"a split read as one range per rank resumes at a step, not at example {first_example} "
                         f"of the epoch (step {first_step} begins at {plan.examples_before(first_step)})")
    counts = [sum(local_sizes(plan, r)) for r in range(plan.world_size)]
    return sum(counts[:plan.rank]), counts[plan.rank]


class StreamingDataset:
    """A classification dataset streamed from files (or the user's pipeline) by tf.data.

    Args:
        name: where it comes from, for the banner.
        train, test: the splits.
        num_classes: ``K``; labels are int32 in ``[0, K)``.
        view: how images become the model's input.
        seed: the run's seed (augmentation, TFRecord shuffles).
        identity: what every rank must agree on, besides the sizes (a digest of the file list).
    """

    def __init__(self, name: str, train: Split, test: Split, num_classes: int, view: ImageView, seed: int,
                 identity: dict):
        self.name, self.train, self.test = name, train, test
        self.num_classes, self.view, self.seed = num_classes, view, seed
        self._identity = identity

    labels = CLASSES  # int32 class indices: one per image, or a map of them (``label_shape``)
    label_shape: Tuple[int, ...] = ()  # a data function's may be (H', W'): one class per pixel

    @property
    def num_train(self) -> int:
        """Training examples."""
        return self.train.num_examples

    @property
    def num_test(self) -> int:
        """Test examples."""
        return self.test.num_examples

    @property
    def input_shape(self) -> Tuple[int, int, int]:
        """``(H, W, C)`` of the model's input."""
        return self.view.input_shape

    @property
    def image_dtype(self) -> tf.DType:
        """The dtype of the batches' images (uint8 unless a data function gives floats)."""
        return getattr(self.train, "image_dtype", tf.uint8)

    def fingerprint(self) -> dict:
        """What every rank must agree on (as :meth:`hvdtrain.data.in_memory.Dataset.fingerprint`)."""
        return {"train_examples": self.num_train, "test_examples": self.num_test,
                "image_shape": list(self.input_shape), "dtype": self.image_dtype.name,
                "num_classes": int(self.num_classes), **self._identity,
                **({"label_shape": list(self.label_shape)} if self.label_shape else {})}

    # ---- pipelines -------------------------------------------------------------------------------
    def _decode(self, split: Split, training: bool, epoch: int):
        """The per-example map: an element -> ``(image, label)``, the image loaded
        (:meth:`Split.load`), then decoded and preprocessed (:mod:`hvdtrain.data.images`) where
        the split holds encoded images."""
        view, seed = self.view, self.seed
        randomized = training and view.augment != "none"

        def decode(*element):
            image, label, key = split.load(*element)
            if split.decodes:  # a JPEG's crop decoded alone (images.decode_view)
                image = images.decode_view(image, view.channels, training, view.augment, view.image_size,
                                           view.stored_shape, images.example_seed(seed, epoch, key) if randomized
                                           else None)
            return image, label

        return decode

    def _check_labels(self, images_, labels):
        """Refuse labels outside ``[0, num_classes)`` (vectorized, on a batch or one example)."""
        tf.debugging.assert_non_negative(labels, message="label below 0")
        tf.debugging.assert_less(labels, tf.constant(self.num_classes, labels.dtype),
                                 message=f"label not below the {self.num_classes} classes")
        return images_, tf.cast(labels, tf.int32)

    def _pipeline(self, split: Split, elements: tf.data.Dataset, training: bool, epoch: int,
                  sizes: Sequence[int], threads: int) -> tf.data.Dataset:
        """Decode in parallel, in order, then cut batches of ``sizes`` (the last may differ)."""
        # One decoding thread per core of the rank: more would take the cores from the step.
        parallel = rank_threads(threads)
        data = elements.map(self._decode(split, training, epoch), num_parallel_calls=parallel, deterministic=True)
        data = data.batch(sizes[0]).rebatch(tf.constant(sizes, tf.int64))  # rebatch cycles through the sizes
        return untuned(data.map(self._check_labels).prefetch(PREFETCH_BATCHES), parallel)

    def train_batches(self, plan: ShardPlan, epoch: int, first_step: int = 0, first_example: int = 0,
                      threads: int = 0) -> Tuple[tf.data.Dataset, List[int]]:
        """This rank's local batches ``(images, labels)`` from ``plan.start_step(first_step,
        first_example)`` to the end of ``epoch``, one per step, and their sizes (the plan's local
        batch sizes; :meth:`Split.rank_elements` says when a ``first_example`` is refused). ``threads``: the
        rank's CPU cores, which the pipeline's threads are limited to (0: the CPUs this process may run on).

        Images are uint8 ``(b, H, W, C)`` (the view's input shape; a data function's own dtype),
        labels int32 ``(b, *label_shape)``.
        """
        threads = rank_threads(threads)
        elements, sizes = self.train.rank_elements(plan, epoch, first_step, first_example, threads)
        if not sizes:
            return tf.data.Dataset.from_tensors(0).take(0), sizes
        return self._pipeline(self.train, elements, True, epoch, sizes, threads), sizes

    def test_batches(self, world_size: int, rank: int, batch_size: int, threads: int = 0) -> tf.data.Dataset:
        """This rank's part of the test split (each example once over all ranks) in batches
        ``(images, labels)`` of up to ``batch_size``: as :meth:`train_batches`' (center crop, no
        augmentation)."""
        elements = self.test.eval_elements(world_size, rank)
        return self._pipeline(self.test, elements, False, 0, [batch_size], threads)

    # ---- what went wrong -------------------------------------------------------------------------
    def failed_step(self, error: Exception, plan: ShardPlan, epoch: int, step: int, first_step: int,
                    first_example: int = 0) -> HvdtrainError:
        """The error for a pipeline that failed at ``step`` (of :meth:`train_batches` with
        ``first_step`` and ``first_example``): decodes this rank's examples of that step and the
        next one by one (eagerly: only after a failure; batching reads a little ahead) and names
        the first that fails, with its step."""
        elements, sizes = self.train.rank_elements(plan, epoch, first_step, first_example)
        first_step = plan.start_step(first_step, first_example)
        i = step - first_step
        before = sum(sizes[:i])
        scanned = elements.skip(before).take(sum(sizes[i:i + 2]))

        def where(position: int) -> str:
            held = i + int(position >= sizes[i])
            return f"epoch {epoch + 1}, step {first_step + held + 1}"

        return self._find_failure(error, self.train, scanned, True, epoch, where)

    def failed_evaluation(self, error: Exception, world_size: int, rank: int) -> HvdtrainError:
        """The error for an evaluation pipeline that failed (as :meth:`failed_step`)."""
        return self._find_failure(error, self.test, self.test.eval_elements(world_size, rank), False, 0,
                                  lambda position: "evaluation")

    def _find_failure(self, error: Exception, split: Split, elements: tf.data.Dataset, training: bool, epoch: int,
                      where) -> HvdtrainError:
        """Decode ``elements`` one by one; the error naming the first that fails (``where(its
        position)`` says when), or, if none does, ``error``'s message."""
        decode = self._decode(split, training, epoch)
        iterator, last, position = iter(elements), None, 0
        while True:
            try:
                element = next(iterator)
            except StopIteration:
                break
            except (tf.errors.OpError, ValueError) as e:  # reading itself failed: after the last good one
                what = "reading the data" + (f" after {split.origin(*last)}" if last is not None else "")
                return HvdtrainError(f"{what}: {tf_message(e)} ({where(position)})")
            try:
                for example in tf.data.Dataset.from_tensors(element).map(decode):
                    self._check_labels(*example)
            except (tf.errors.OpError, ValueError) as e:
                hint = ("; images of different sizes need --image-size" if split.decodes and not self.view.image_size
                        and "expected shape" in str(e) else "")
                return HvdtrainError(f"{split.origin(*element)}: {tf_message(e)} ({where(position)}){hint}")
            last, position = element, position + 1
        return HvdtrainError(f"the input pipeline failed at {where(0)}: {tf_message(error)}")


def tf_message(error: Exception) -> str:
    """TensorFlow's message without its op, function and iterator decoration."""
    message = getattr(error, "message", None) or str(error)
    message = re.sub(r"\{\{[^}]*\}\}", "", message.split("\n")[0])
    message = re.sub(r"^.*Iterator::\S+: ", "", message)
    message = re.sub(r"record at (\d+)' failed with ", r"record at byte \1: ", message)  # TensorFlow's stray quote
    for marker in ("Condition x", "[Op:", "\t"):
        message = message.split(marker)[0]
    return message.strip().rstrip(".; ") or type(error).__name__


def stored_shape(encoded: tf.Tensor, where: str) -> Tuple[int, int, int]:
    """``(H, W, C)`` of one encoded image (eager), C taken to 1 (grayscale) or 3: every image of
    the dataset is decoded to that many channels.

    Raises:
        HvdtrainError: ``"<where>: cannot decode it (...)"`` for bytes that are no image.
    """
    try:
        image = tf.io.decode_image(encoded, expand_animations=False)
    except (tf.errors.OpError, ValueError) as e:
        raise HvdtrainError(f"{where}: cannot decode it ({tf_message(e)})") from None
    height, width, channels = image.shape
    return int(height), int(width), 1 if channels == 1 else 3


def contiguous_segments(counts: Sequence[int], order: Sequence[int], first: int, count: int) -> List[Tuple[int, int, int]]:
    """The positions ``[first, first + count)`` of a stream of files read in ``order`` (``counts``
    records each) as ``(file, skip, take)`` segments: records ``skip .. skip + take`` of ``file``."""
    segments, position = [], 0
    end = first + count
    for f in order:
        n = counts[f]
        lo, hi = max(first, position), min(end, position + n)
        if lo < hi:
            segments.append((int(f), int(lo - position), int(hi - lo)))
        position += n
        if position >= end:
            break
    return segments

