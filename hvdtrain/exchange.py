"""The gradient exchange: every rank's gradients -> their average (or sum) over ranks.

Dense gradients travel in fixed buckets (:func:`buckets`): the same tensors, in the same order, in
every step of every run, each bucket one ``hvd.grouped_allreduce``. Horovod fuses a group's tensors
into one buffer and, with ``HOROVOD_DISABLE_GROUP_FUSION=1`` (which :func:`hvdtrain.init_distributed`
sets unless the user did), never with another group's. The ring's chunks, and so the order of every
element's sum, are then the same each time: on the same machine and stack, runs repeat bit for bit at
any world size with fusion kept. (Horovod's own default fuses whatever is ready in one cycle, by
timing: horovod#1548.) The price of that setting: Horovod then makes every collective a group of its
own, so plain ``hvd.allreduce`` calls of the user's own code are no longer fused with each other.

A sparse gradient (``tf.IndexedSlices``, an embedding's: the rows one batch touched) has its
duplicate rows summed on the rank first, then crosses ranks the cheaper of two ways, per variable and
per step (:func:`sparse_bytes`, :func:`table_bytes`):

* allgather of the unique rows with their ids (one buffer), then duplicates across ranks summed in
  rank order:
  bytes sent per rank ``(N-1)/N · R · (D·s + 8)``, where ``R`` is the unique rows of all ranks
  together (each rank's own counted), ``D`` the row's size, ``s`` a value's bytes after compression
  and 8 an int64 id's;
* dense ring-allreduce of the table with one more column, how many ranks touched each row:
  ``2 · (N-1)/N · V · (D+1) · s`` for a ``V``-row table.

Every rank must pick the same way, or one waits in a collective the others skipped: the unique row
counts of every sparse gradient go through one small integer allreduce first, and each rank decides
from those sums, which are the same numbers on every rank. Either way the gradient handed on is an
``IndexedSlices`` of the rows some rank touched, each once: no table-sized dense gradient where the
sparse way is cheaper, and a row-lazy optimizer updates the same rows whichever way won.
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence

import tensorflow as tf

#: Largest bucket, bytes: PyTorch DDP's default bucket cap (Li et al. 2020, "PyTorch Distributed:
#: Experiences on Accelerating Data Parallel Training"); smaller buckets start their allreduce while
#: the backward pass still runs, larger ones cost fewer collectives.
BUCKET_CAP_BYTES = 25 * 2 ** 20
_HOROVOD_FUSION_DEFAULT = 128 * 2 ** 20  # Horovod's own HOROVOD_FUSION_THRESHOLD default


def bucket_cap_bytes() -> int:
    """The bucket cap: :data:`BUCKET_CAP_BYTES`, or Horovod's fusion threshold where that is smaller
    (``HOROVOD_FUSION_THRESHOLD=0``: every gradient its own bucket), so a bucket is one fused buffer."""
    threshold = int(os.environ.get("HOROVOD_FUSION_THRESHOLD", _HOROVOD_FUSION_DEFAULT))
    return min(BUCKET_CAP_BYTES, max(threshold, 0))


def buckets(sizes: Sequence[Optional[int]], dtypes: Sequence[tf.DType], cap_bytes: int) -> List[List[int]]:
    """Split dense tensors into buckets: lists of their positions.

    Args:
        sizes: each tensor's bytes as Horovod receives it (after compression), or None where its
            shape is not static: such a tensor is a bucket of its own (:func:`wire_sizes`).
        dtypes: each tensor's dtype as Horovod receives it (after compression).
        cap_bytes: the largest bucket.

    Reverse order (the backward pass makes the last layers' gradients first), one dtype per bucket
    (Horovod fuses one dtype), a new bucket once the next tensor would take it past ``cap_bytes``;
    buckets in the order of their first tensor. Only static sizes and dtypes decide, so the buckets
    are the same on every rank and every step.
    """
    open_buckets, closed = {}, []
    for i in reversed(range(len(sizes))):
        size, dtype = sizes[i], dtypes[i]
        if size is None:
            closed.append([i])
            continue
        bucket = open_buckets.get(dtype)
        if bucket is not None and bucket[1] + size > cap_bytes:
            closed.append(bucket[0])
            bucket = None
        if bucket is None:
            bucket = open_buckets[dtype] = [[], 0]
        bucket[0].append(i)
        bucket[1] += size
    return sorted(closed + [b[0] for b in open_buckets.values()], key=lambda b: -b[0])


def sparse_bytes(world_size: int, rows, row_elements: int, value_bytes: int, id_bytes: int):
    """Bytes each rank sends to allgather ``rows`` unique rows in all (ring allgather)."""
    return (world_size - 1) * rows * (row_elements * value_bytes + id_bytes) // world_size


def dense_bytes(world_size: int, table_rows: int, row_elements: int, value_bytes: int) -> int:
    """Bytes each rank sends to ring-allreduce a ``table_rows``-row table (reduce-scatter, then allgather)."""
    return 2 * (world_size - 1) * table_rows * row_elements * value_bytes // world_size


def table_bytes(world_size: int, table_rows: int, row_elements: int, value_bytes: int) -> int:
    """Bytes each rank sends for hvdtrain's dense way of a sparse gradient: the table and one more
    column (how many ranks touched each row), ring-allreduced."""
    return dense_bytes(world_size, table_rows, row_elements + 1, value_bytes)


def _compressed_dtype(compression, dtype: tf.DType) -> tf.DType:
    """What a value of ``dtype`` becomes under Horovod's ``compression``."""
    probe, _ = compression.compress(tf.zeros([0], dtype))
    return probe.dtype


def _compressed_size(compression, dtype: tf.DType) -> int:
    """Bytes of one value of ``dtype`` after Horovod's ``compression``."""
    return _compressed_dtype(compression, dtype).size


def wire_dtype(compression, dtype: tf.DType) -> tf.DType:
    """The dtype a dense allreduce of ``dtype`` values takes before compression: ``dtype``, or
    float32 for bfloat16 that compression leaves as it is (Horovod's allreduce has no bfloat16 kernel)."""
    return tf.float32 if dtype == tf.bfloat16 and _compressed_dtype(compression, dtype) == tf.bfloat16 else dtype


def wire_sizes(tensors: Sequence[tf.Tensor], variables: Sequence, compression) -> tuple:
    """``(sizes, dtypes)`` of dense ``tensors`` as Horovod receives them, for :func:`buckets`: bytes
    after compression (from the variable's shape where the tensor's is not static, None where
    neither is) and the compressed dtype."""
    sizes, dtypes = [], []
    for t, v in zip(tensors, variables):
        shape = t.shape if t.shape.is_fully_defined() or v is None else tf.TensorShape(v.shape)
        wire = _compressed_dtype(compression, wire_dtype(compression, t.dtype))
        sizes.append(shape.num_elements() * wire.size if shape.is_fully_defined() else None)
        dtypes.append(wire)
    return sizes, dtypes


def unique_rows(slices: tf.IndexedSlices) -> tf.IndexedSlices:
    """``slices`` with each row id once, its rows summed (in the order they came), ids int64."""
    ids, position = tf.unique(tf.cast(slices.indices, tf.int64))
    values = tf.math.unsorted_segment_sum(slices.values, position, tf.size(ids))
    return tf.IndexedSlices(values, ids, slices.dense_shape)


_SAME_WIDTH_INT = {2: tf.int16, 4: tf.int32, 8: tf.int64}


class Exchange:
    """``(gradients, variables=None) -> gradients`` over ranks: Horovod's ``_allreduce_grads`` contract.

    Args:
        average: divide the sum by the world size (Horovod's ``op=Average``), else the sum.
        compression: Horovod's ``Compression.none`` or ``Compression.fp16``, for dense and sparse values alike.
        cap_bytes: the bucket cap (:func:`bucket_cap_bytes` when None).

    Call arguments:
        gradients: one per variable, each None, a dense ``tf.Tensor`` or a ``tf.IndexedSlices``.
        variables: the variables, one per gradient, or None. Where a gradient's shape is not static
            (a dense one from a tf.function of unknown batch, or an ``IndexedSlices`` whose
            ``dense_shape`` is not a constant) the variable's shape stands in for it.

    Returns:
        A list like ``gradients``: None as None, dense as dense (same dtype), ``IndexedSlices`` as
        ``IndexedSlices`` of the rows some rank touched, each id once (int64), whichever way it travelled.

    Raises:
        ValueError: for a sparse gradient whose table rows or row size are known neither from it
            nor from its variable.

    Attributes:
        choices: after a trace, for each sparse gradient of the last call, a bool tensor: True where
            it was allgathered (for tests and benchmarks).

    The world size is Horovod's when the call is traced (an elastic run retraces its step after a reset);
    at 1 the gradients pass as they are.
    """

    def __init__(self, average: bool = True, compression=None, cap_bytes: Optional[int] = None):
        import horovod.tensorflow as hvd

        self.average = average
        self.compression = compression or hvd.Compression.none
        self.cap_bytes = bucket_cap_bytes() if cap_bytes is None else cap_bytes
        self.choices: List[tf.Tensor] = []

    def __call__(self, gradients: Sequence, variables: Optional[Sequence] = None) -> list:
        import horovod.tensorflow as hvd

        gradients = list(gradients)
        variables = list(variables) if variables is not None else [None] * len(gradients)
        self.choices = []
        self.world_size = hvd.size()
        if self.world_size == 1:
            return gradients
        sparse = [i for i, g in enumerate(gradients) if isinstance(g, tf.IndexedSlices)]
        dense = [i for i, g in enumerate(gradients) if g is not None and not isinstance(g, tf.IndexedSlices)]
        for i, reduced in zip(sparse, self._sparse([gradients[i] for i in sparse], [variables[i] for i in sparse])):
            gradients[i] = reduced
        for i, reduced in zip(dense, self._dense([tf.convert_to_tensor(gradients[i]) for i in dense],
                                                 [variables[i] for i in dense])):
            gradients[i] = reduced
        return gradients

    def _dense(self, tensors: List[tf.Tensor], variables: list) -> List[tf.Tensor]:
        """One grouped allreduce per bucket, buckets in their fixed order."""
        import horovod.tensorflow as hvd

        sizes, dtypes = wire_sizes(tensors, variables, self.compression)
        out = list(tensors)
        op = hvd.Average if self.average else hvd.Sum
        for bucket in buckets(sizes, dtypes, self.cap_bytes):
            sent = [tf.cast(tensors[i], wire_dtype(self.compression, tensors[i].dtype)) for i in bucket]
            reduced = hvd.grouped_allreduce(sent, op=op, compression=self.compression)
            for i, r in zip(bucket, reduced):
                out[i] = tf.cast(r, tensors[i].dtype)
        return out

    def _sparse(self, slices: List[tf.IndexedSlices], variables: list) -> List[tf.IndexedSlices]:
        """Each one allgathered or densely allreduced, as the allreduced row counts decide."""
        import horovod.tensorflow as hvd

        if not slices:
            return []
        local = [unique_rows(s) for s in slices]
        # The same sums on every rank, so every rank takes the same branch of each tf.cond below.
        rows = hvd.allreduce(tf.stack([tf.size(s.indices, out_type=tf.int64) for s in local]), op=hvd.Sum)
        out = []
        for k, s in enumerate(local):
            table_rows, row_shape = _table_shape(slices[k], variables[k])
            row_elements = row_shape.num_elements()
            s = tf.IndexedSlices(tf.reshape(s.values, [-1, *row_shape]), s.indices, s.dense_shape)
            dtype = s.values.dtype
            gathered_value_bytes = _compressed_size(self.compression, dtype)
            table_value_bytes = _compressed_size(self.compression, wire_dtype(self.compression, dtype))
            gather = (sparse_bytes(self.world_size, rows[k], row_elements, gathered_value_bytes, 8)
                      < table_bytes(self.world_size, table_rows, row_elements, table_value_bytes))
            self.choices.append(gather)
            out.append(tf.cond(gather, lambda s=s: self._allgather(s),
                               lambda s=s, n=table_rows: self._allreduce_table(s, n)))
        return out

    def _allgather(self, s: tf.IndexedSlices) -> tf.IndexedSlices:
        """One allgather of the rows with their ids, then the rows of each id summed in rank order."""
        import horovod.tensorflow as hvd

        values, context = self.compression.compress(s.values)
        row_shape, width = values.shape[1:], values.shape[1:].num_elements()
        # Rows and ids travel as one buffer of integers as wide as a value (an allgather copies
        # bytes, so nothing rounds, and bfloat16, which Horovod's allgather lacks, travels too).
        word = _SAME_WIDTH_INT[values.dtype.size]
        ids = tf.reshape(tf.bitcast(s.indices, word), [-1, 8 // word.size])
        packed = tf.concat([tf.reshape(tf.bitcast(values, word), [-1, width]), ids], axis=1)
        gathered = hvd.allgather(packed)
        values = tf.bitcast(tf.reshape(gathered[:, :width], [-1, *row_shape]), values.dtype)
        values = self.compression.decompress(values, context)
        indices = gathered[:, width:]
        indices = tf.bitcast(indices, tf.int64) if word != tf.int64 else tf.reshape(indices, [-1])
        summed = unique_rows(tf.IndexedSlices(values, indices, s.dense_shape))
        if self.average:
            summed = tf.IndexedSlices(summed.values / tf.cast(self.world_size, values.dtype), summed.indices,
                                      summed.dense_shape)
        return summed

    def _allreduce_table(self, s: tf.IndexedSlices, table_rows: int) -> tf.IndexedSlices:
        """The table allreduced with one more column, how many ranks touched each row, so the
        result holds the same rows as the allgather's (a row-lazy optimizer updates the same rows)."""
        import horovod.tensorflow as hvd

        dtype = s.values.dtype
        flat = tf.cast(tf.reshape(s.values, [tf.shape(s.values)[0], -1]), wire_dtype(self.compression, dtype))
        touched = tf.ones([tf.shape(flat)[0], 1], flat.dtype)
        table = tf.math.unsorted_segment_sum(tf.concat([flat, touched], axis=1), s.indices, table_rows)
        table = hvd.grouped_allreduce([table], op=hvd.Average if self.average else hvd.Sum,
                                      compression=self.compression)[0]
        ids = tf.where(table[:, -1] > 0)[:, 0]
        values = tf.cast(tf.reshape(tf.gather(table, ids)[:, :-1], [-1, *s.values.shape[1:]]), dtype)
        return tf.IndexedSlices(values, ids, s.dense_shape)


def _table_shape(slices: tf.IndexedSlices, variable) -> tuple:
    """``(rows, row shape)`` of the gradient's variable: from the gradient where static, else the variable."""
    shape = tf.get_static_value(slices.dense_shape) if slices.dense_shape is not None else None
    if shape is None and variable is not None and tf.TensorShape(variable.shape).is_fully_defined():
        shape = tf.TensorShape(variable.shape).as_list()
    if shape is None:
        raise ValueError(f"a sparse gradient ({slices.values.name}) needs its table's shape: its dense_shape "
                         f"is not static, and " + ("no variable was given" if variable is None else
                                                   f"its variable's shape is {tf.TensorShape(variable.shape)}"))
    return int(shape[0]), tf.TensorShape([int(d) for d in shape[1:]])
