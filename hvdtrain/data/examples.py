"""Examples in the forms Keras' ``fit`` takes, sharded exactly over ranks.

An example is ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)`` (Keras'
``unpack_x_y_sample_weight``), each part any nest (dict, tuple, list) of tensors of any dtype and
rank: images, float tables, int token ids, strings, variable-length sequences. One structure per
dataset, declared by the data and carried unchanged to the model's own ``train_step``.

* :class:`Examples`: arrays held in memory (numpy, or ``tf.RaggedTensor`` for variable-length
  rows); each step gathers the local batch's rows by the :class:`~hvdtrain.data.sharding.ShardPlan`'s
  indices, exactly as the image path does.
* :class:`StreamedExamples`: two ``tf.data`` datasets of unbatched examples; each epoch shuffles
  the training set alike on every rank, and rank ``r`` reads its own contiguous range of that
  stream (:func:`~hvdtrain.data.stream.rank_range`) in local batches of the plan's sizes.

Variable-length rows are padded per batch with zeros (``padded_batch``, ``RaggedTensor.to_tensor``),
as Keras users pad them; a model with ``mask_zero`` or ``Masking`` then ignores the padding.
"""
from __future__ import annotations

import hashlib
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from hvdtrain.data.sharding import ShardPlan, eval_shard
from hvdtrain.data.stream import local_sizes, rank_range, untuned
from hvdtrain.errors import HvdtrainError

PARTS = ("x", "y", "sample_weight")


def path_name(part: str, path: Tuple) -> str:
    """``x['ids']``, ``y[1]``, ``sample_weight``: a leaf's name in error messages."""
    return part + "".join(f"[{key!r}]" for key in path)


def leaves(example: tuple) -> List[Tuple[str, object]]:
    """``[(name, leaf), ...]`` of an example ``(x[, y[, sample_weight]])``, in ``tf.nest`` order."""
    return [(path_name(part, path), leaf) for part, nest in zip(PARTS, example) for path, leaf in leaf_paths(nest)]


def leaf_paths(nest) -> List[Tuple[Tuple, object]]:
    """``[(path, leaf)]`` of ``nest`` with dict keys and sequence indices as the path."""
    from tensorflow.python.util import nest as tf_nest  # the one public-enough walker with paths

    return list(tf_nest.flatten_with_tuple_paths(nest))


def as_example(element, where: str) -> tuple:
    """A dataset element or ``fit``'s arguments as ``(x,)``, ``(x, y)`` or ``(x, y, w)``: a tuple of 1 to
    3 is Keras' ``(x, y, sample_weight)``; anything else (a dict, one tensor) is ``x`` alone.

    Raises:
        HvdtrainError: for a tuple of more than 3 parts.
    """
    if isinstance(element, tuple):
        if not 1 <= len(element) <= 3:
            raise HvdtrainError(f"{where}: an example is (x,), (x, y) or (x, y, sample_weight), got a tuple of "
                                f"{len(element)}")
        return element
    return (element,)


def class_weights(y, class_weight: Dict[int, float], where: str) -> np.ndarray:
    """float32 ``(n,)`` sample weights from ``class_weight`` ``{class: weight}`` (Keras' rule:
    classes not named weigh 1), for ``y`` class indices ``(n,)``/``(n, 1)`` or one-hot ``(n, K)``.

    Raises:
        HvdtrainError: for labels of several outputs, or a class that no label holds.
    """
    if not isinstance(y, np.ndarray):
        raise HvdtrainError(f"{where}: class_weight needs one label array of class indices, got "
                            f"{type(y).__name__} (several outputs: give sample_weight per output)")
    classes = np.argmax(y, axis=-1) if y.ndim > 1 and y.shape[-1] > 1 else np.round(y.reshape(len(y))).astype(np.int64)
    present = set(np.unique(classes).tolist())
    unknown = sorted(set(int(c) for c in class_weight) - present)
    if unknown:
        raise HvdtrainError(f"{where}: class_weight names class(es) {unknown} that no training label holds "
                            f"(the labels hold {min(present)}..{max(present)})")
    weights = np.ones(len(classes), np.float32)
    for cls, weight in class_weight.items():
        weights[classes == int(cls)] = float(weight)
    return weights


def _array(leaf, name: str, where: str):
    """A leaf as a numpy array (strings as ``object`` of ``str``), or a ``tf.RaggedTensor`` as it is."""
    if isinstance(leaf, tf.RaggedTensor):
        return leaf
    array = leaf.numpy() if isinstance(leaf, tf.Tensor) else np.asarray(leaf)
    if array.dtype == object and array.ndim == 1 and len(array) and isinstance(array[0], (list, np.ndarray)):
        raise HvdtrainError(f"{where}: {name} holds rows of different lengths; give them as a tf.RaggedTensor "
                            f"(tf.ragged.constant), or pad them (keras.utils.pad_sequences)")
    if array.ndim == 0:
        raise HvdtrainError(f"{where}: {name} is a scalar; every part holds one row per example")
    if array.dtype.kind == "U":
        array = array.astype(object)
    return array


def _rows(leaf) -> int:
    return int(leaf.nrows()) if isinstance(leaf, tf.RaggedTensor) else len(leaf)


def _digest_leaf(digest, leaf) -> None:
    if isinstance(leaf, tf.RaggedTensor):
        for part in (leaf.flat_values, *leaf.nested_row_splits):
            _digest_leaf(digest, part.numpy())
    elif leaf.dtype == object:
        for item in leaf.ravel():
            digest.update(item if isinstance(item, bytes) else str(item).encode())
            digest.update(b"\0")
    else:
        digest.update(np.ascontiguousarray(leaf).data)


def structure_of(example: tuple) -> List[str]:
    """One line per leaf, ``name dtype (shape)`` with ``None`` for variable dims: what every rank
    must agree on, and the banner shows."""
    out = []
    for name, leaf in leaves(example):
        if isinstance(leaf, tf.RaggedTensor):
            shape, dtype = [None] * (leaf.shape.rank - 1), leaf.dtype.name
        elif isinstance(leaf, (tf.TensorSpec, tf.RaggedTensorSpec)):
            shape, dtype = leaf.shape.as_list()[1:], leaf.dtype.name
        else:
            shape, dtype = list(leaf.shape[1:]), "string" if leaf.dtype == object else leaf.dtype.name
        out.append(f"{name} {dtype} ({', '.join('None' if d is None else str(d) for d in shape)})")
    return out


def _spec(leaf) -> tf.TypeSpec:
    """The batched spec of a leaf, the batch and variable dims None."""
    if isinstance(leaf, tf.RaggedTensor):  # padded per batch: a dense tensor
        return tf.TensorSpec([None] * leaf.shape.rank, leaf.dtype)
    dtype = tf.string if leaf.dtype == object else tf.as_dtype(leaf.dtype)
    return tf.TensorSpec([None, *leaf.shape[1:]], dtype)


class Examples:
    """Examples held in memory, in Keras' ``fit`` forms (see the module).

    Args:
        train: ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)``: nests of arrays ``(n, ...)``,
            numpy (any dtype; strings as ``str``/``bytes``) or ``tf.RaggedTensor`` (``(n, None, ...)``,
            padded with zeros per batch).
        test: the same structure for evaluation, or None.
        name: where they came from, for the banner.

    Raises:
        HvdtrainError: naming the part (``x['ids']``) whose rows differ in number from the others', a
            test set of another structure or dtype, or no example.
    """

    def __init__(self, train: tuple, test: Optional[tuple] = None, name: str = "arrays"):
        self.name = name
        self.train = self._checked(train, "the training data")
        self.test = self._checked(test, "the test data") if test is not None else None
        if self.test is not None and structure_of(self.test) != structure_of(self.train):
            raise HvdtrainError(f"{name}: the test data's structure differs from the training data's: "
                                f"{'; '.join(structure_of(self.test))} against {'; '.join(structure_of(self.train))}")

    def _checked(self, example: tuple, what: str) -> tuple:
        example = as_example(example, f"{self.name}: {what}")
        example = tuple(tf.nest.pack_sequence_as(part, [_array(leaf, path_name(name, path), f"{self.name}: {what}")
                                                        for path, leaf in leaf_paths(part)])
                        for name, part in zip(PARTS, example))
        counts = {name: _rows(leaf) for name, leaf in leaves(example)}
        if len(set(counts.values())) > 1:
            raise HvdtrainError(f"{self.name}: {what} holds different numbers of examples per part: "
                                + ", ".join(f"{k} {v}" for k, v in counts.items()))
        if not counts or not next(iter(counts.values())):
            raise HvdtrainError(f"{self.name}: {what} holds no example")
        return example

    @property
    def num_train(self) -> int:
        return _rows(leaves(self.train)[0][1])

    @property
    def num_test(self) -> int:
        return 0 if self.test is None else _rows(leaves(self.test)[0][1])

    @property
    def structure(self) -> List[str]:
        return structure_of(self.train)

    def summary(self) -> str:
        """The banner's data line."""
        return (f"{self.name}: {self.num_train:,} train / {self.num_test:,} test examples, in memory; "
                + "; ".join(self.structure))

    def fingerprint(self) -> dict:
        """What every rank must agree on: sizes, each leaf's name, dtype and shape, and a BLAKE2b
        digest (hex, 128 bits) of each leaf's values."""
        digests = {}
        for split, example in (("train", self.train), ("test", self.test or ())):
            for name, leaf in leaves(example):
                digest = hashlib.blake2b(digest_size=16)
                _digest_leaf(digest, leaf)
                digests[f"{split} {name}"] = digest.hexdigest()  # a rank's other data named by its part
        return {"train_examples": self.num_train, "test_examples": self.num_test, "structure": self.structure,
                "digest": digests}

    def on_device(self, example: tuple) -> tuple:
        """The example's arrays as tensors (call under the rank's device)."""
        return tuple(tf.nest.map_structure(
            lambda a: a if isinstance(a, tf.RaggedTensor) else tf.constant(a, tf.string if a.dtype == object else None),
            part) for part in example)

    def rows(self, indices: np.ndarray) -> tuple:
        """The training rows ``indices`` as one batch of tensors (ragged rows padded), copying
        only those rows."""
        def take(leaf):
            if isinstance(leaf, tf.RaggedTensor):
                return tf.gather(leaf, indices).to_tensor()
            return tf.constant(leaf[indices], tf.string if leaf.dtype == object else None)

        return tuple(tf.nest.map_structure(take, part) for part in self.train)

    def batch_spec(self) -> tuple:
        """The ``tf.TypeSpec`` nest of one local batch."""
        return tuple(tf.nest.map_structure(_spec, part) for part in self.train)


def gather_rows(tensors: tuple, indices: tf.Tensor) -> tuple:
    """The rows ``indices`` int32 ``(b,)`` of every leaf; ragged leaves padded with zeros to the
    batch's longest row."""
    def rows(leaf):
        taken = tf.gather(leaf, indices)
        return taken.to_tensor() if isinstance(taken, tf.RaggedTensor) else taken

    return tuple(tf.nest.map_structure(rows, part) for part in tensors)


def batch_size_of(example: tuple) -> tf.Tensor:
    """int32 scalar: the rows of the example's first leaf."""
    return tf.shape(tf.nest.flatten(example)[0])[0]


class StreamedExamples:
    """Examples streamed by ``tf.data`` from two datasets of unbatched examples (see the module).

    Args:
        train: a ``tf.data.Dataset`` of unbatched ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)``
            (or ``x`` alone: a dict, a tensor), one pass of the split, the same on every rank.
        test: the same structure, or None.
        shuffle_buffer: the training set's shuffle buffer (``>= num_train``: a full shuffle).
        seed: the run's seed: epoch ``e``'s order depends on ``(seed, e)`` only.
        name: for the banner.

    Raises:
        HvdtrainError: for an infinite or batched dataset, no example, or a test set of another
            structure.
    """

    def __init__(self, train: tf.data.Dataset, test: Optional[tf.data.Dataset], shuffle_buffer: int, seed: int,
                 name: str = "tf.data"):
        self.name, self.shuffle_buffer, self.seed = name, shuffle_buffer, seed
        self.train, self.num_train = self._checked(train, "train")
        self.test, self.num_test = self._checked(test, "test") if test is not None else (None, 0)
        if self.test is not None and dataset_structure(self.test) != self.structure:
            raise HvdtrainError(f"{name}: the test set's elements differ from the training set's: "
                                f"{'; '.join(dataset_structure(self.test))} against {'; '.join(self.structure)}")
        if not self.num_train:
            raise HvdtrainError(f"{name}: the training dataset holds no example")

    @classmethod
    def of_function(cls, fn, where: str, rank: int, world_size: int, seed: int,
                    shuffle_buffer: int) -> "StreamedExamples":
        """A data function's splits: ``fn(split="train" | "test", rank=, world_size=, seed=, epoch=0)``
        (:mod:`hvdtrain.data.function`'s signature), each called once (``test`` may return None);
        ``where`` names it in messages.

        Raises:
            HvdtrainError: naming ``where`` and the split, if the function raises or returns no dataset.
        """
        def split(name: str):
            try:
                return fn(split=name, rank=rank, world_size=world_size, seed=seed, epoch=0)
            except Exception as e:  # noqa: BLE001 -- the user's code: any error becomes one clear message
                raise HvdtrainError(f"{where}: the function raised {type(e).__name__}: {e} (split {name!r})") from None

        return cls(split("train"), split("test"), shuffle_buffer, seed, name=where)

    def _checked(self, data, split: str):
        where = f"{self.name} ({split} set)"
        if not isinstance(data, tf.data.Dataset):
            raise HvdtrainError(f"{where}: must be a tf.data.Dataset, got {type(data).__name__}")
        if isinstance(data.element_spec, tuple) and len(data.element_spec) > 3:
            as_example(data.element_spec, where)
        if batched(data):
            raise HvdtrainError(f"{where}: the dataset is batched; give unbatched examples (hvdtrain batches them to "
                                f"the plan's local batch sizes)")
        if not isinstance(data.element_spec, tuple):
            data = data.map(lambda *e: e if len(e) > 1 else (e[0],))
        if data.cardinality() == tf.data.INFINITE_CARDINALITY:
            raise HvdtrainError(f"{where}: the dataset is infinite (.repeat()?): give one pass of the split; hvdtrain "
                                f"makes the epochs")
        count = int(data.cardinality())
        if count < 0:
            count = int(untuned(data.map(lambda *e: 0)).reduce(np.int64(0), lambda n, _: n + 1))
        return data, count

    @property
    def structure(self) -> List[str]:
        return dataset_structure(self.train)

    def summary(self) -> str:
        return (f"{self.name}: {self.num_train:,} train / {self.num_test:,} test examples, streamed by tf.data; "
                + "; ".join(self.structure))

    def fingerprint(self) -> dict:
        return {"train_examples": self.num_train, "test_examples": self.num_test, "structure": self.structure}

    def batch_spec(self) -> tuple:
        """The ``tf.TensorSpec`` nest of one local batch: every dimension None (padded lengths vary
        per batch; a trace per shape would be one per length)."""
        return tuple(tf.nest.map_structure(lambda s: tf.TensorSpec([None] * (s.shape.rank + 1), s.dtype), part)
                     for part in self.train.element_spec)

    def train_batches(self, plan: ShardPlan, epoch: int, first_step: int = 0, first_example: int = 0,
                      threads: int = 0) -> Tuple[tf.data.Dataset, List[int]]:
        """This rank's local batches from ``plan.start_step(first_step, first_example)`` to the end of
        ``epoch``, and their sizes (the plan's)."""
        first, count = rank_range(plan, first_step, first_example)
        sizes = local_sizes(plan, plan.rank)
        done = sum(sizes[:first_step])
        # One seed per (seed, epoch), alike on every rank: every rank cuts its range of one order.
        order = self.train.shuffle(self.shuffle_buffer, seed=self.seed * 1_000_003 + epoch,
                                   reshuffle_each_iteration=False)
        mine = order.skip(first + done).take(count - done)
        return untuned(padded_batches(mine, sizes[first_step:]).prefetch(2), threads), sizes[first_step:]

    def test_batches(self, world_size: int, rank: int, batch_size: int, threads: int = 0) -> tf.data.Dataset:
        """This rank's part of the test set (each example once over all ranks), in batches of up to ``batch_size``."""
        part = eval_shard(self.num_test, world_size, rank)
        mine = self.test.skip(part.start).take(part.stop - part.start)
        return untuned(padded_batches(mine, [batch_size] * -(-len(range(part.start, part.stop)) // batch_size))
                       .prefetch(2), threads)

    def failed_step(self, error: Exception, plan: ShardPlan, epoch: int, step: int, first_step: int,
                    first_example: int = 0) -> HvdtrainError:
        """The error for a pipeline that failed at ``step`` of ``epoch``."""
        first = (str(getattr(error, "message", error)).strip().splitlines() or [""])[0]
        return HvdtrainError(f"{self.name}: the training data failed at epoch {epoch + 1}, step {step + 1} on rank "
                             f"{plan.rank}: {type(error).__name__}: {first}")

    def failed_evaluation(self, error: Exception, world_size: int, rank: int) -> HvdtrainError:
        """The error for a test pipeline that failed."""
        first = (str(getattr(error, "message", error)).strip().splitlines() or [""])[0]
        return HvdtrainError(f"{self.name}: the test data failed on rank {rank}: {type(error).__name__}: {first}")


def dataset_structure(data: tf.data.Dataset) -> List[str]:
    """:func:`structure_of` a dataset of unbatched examples (as its batches will be)."""
    return structure_of(tf.nest.map_structure(lambda s: tf.TensorSpec([None, *s.shape.as_list()], s.dtype),
                                              data.element_spec))


def batched(data: tf.data.Dataset) -> bool:
    """Whether ``data`` or a dataset it is made of was batched (``batch``, ``padded_batch``,
    ``ragged_batch``; tf.data has no public test): its input chain, back to the source."""
    while data is not None:
        if "Batch" in type(data).__name__:
            return True
        data = getattr(data, "_input_dataset", None)
    return False


def dense_rows(element):
    """An element with its ragged parts (a ragged row of ``from_tensor_slices``) as dense tensors."""
    return tf.nest.map_structure(lambda t: t.to_tensor() if isinstance(t, tf.RaggedTensor) else t, element)


def padded_batches(data: tf.data.Dataset, sizes: Sequence[int]) -> tf.data.Dataset:
    """``data`` cut into consecutive batches of ``sizes``, each padded with zeros to its longest
    element (``padded_batch``; fixed shapes are unchanged)."""
    if any(isinstance(spec, tf.RaggedTensorSpec) for spec in tf.nest.flatten(data.element_spec)):
        parts = isinstance(data.element_spec, tuple)  # tf.data passes a tuple's parts as arguments
        data = data.map(lambda *e: dense_rows(e) if parts else dense_rows(e[0]))
    runs, start = [], 0
    for size in sizes:  # runs of equal sizes: one padded_batch each
        if runs and runs[-1][0] == size:
            runs[-1][1] += 1
        else:
            runs.append([size, 1])
    out = None
    for size, count in runs:
        part = data.skip(start).take(size * count).padded_batch(size)
        out = part if out is None else out.concatenate(part)
        start += size * count
    return out if out is not None else data.take(0).batch(1)

