"""Rank script: hvdtrain.exchange.Exchange on known gradients against their dense average (numpy, float64).

Each rank makes its own gradients from its rank (seeded): two dense ones (the first of a shape the
trace does not know, as a step of unknown batch makes it); a 20,000-row table whose batch touches a
few rows, with duplicate ids (the allgather is cheaper); a 6-row table whose batches touch rows 0-4
only (the dense allreduce is cheaper, and row 5 must not come back); a table that rank 1 does not
touch at all, its dense_shape not a constant (the variable's shape stands in); and a None. Prints one
JSON line per rank: each gradient's relative gap to the dense average, the choices, and whether each
sparse result holds exactly the rows some rank touched, each once.

    horovodrun -np 3 --gloo python tests/workers/exchange_cases.py [--fp16] [--sum] [--float64 | --bfloat16]
"""
import argparse
import json

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from hvdtrain.exchange import Exchange

TABLES = {"wide": (20000, 8), "narrow": (6, 3), "untouched_on_1": (300, 4)}


def gradients_of(rank: int, dtype):
    """This rank's gradients, as numpy: dense arrays, and (ids, rows, table shape) for the sparse ones."""
    rng = np.random.default_rng(rank)
    dense = [rng.normal(size=(3, 4)).astype(np.float32), rng.normal(size=(5,)).astype(np.float32)]
    wide = rng.integers(0, 40, size=25)  # few rows, many of them twice
    narrow = np.concatenate([np.arange(5), rng.integers(0, 5, size=4)])
    untouched = np.zeros([0], np.int64) if rank == 1 else rng.integers(0, 300, size=7)
    sparse = []
    for ids, (rows, dim) in zip([wide, narrow, untouched], TABLES.values()):
        sparse.append((ids.astype(np.int32), rng.normal(size=(len(ids), dim)).astype(dtype), (rows, dim)))
    return [d.astype(dtype) for d in dense], sparse


def as_dense(ids, rows, shape):
    table = np.zeros(shape, np.float64)
    np.add.at(table, ids, rows.astype(np.float64))
    return table


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--sum", action="store_true")
    parser.add_argument("--float64", action="store_true")
    parser.add_argument("--bfloat16", action="store_true")
    args = parser.parse_args()
    dtype = tf.float64 if args.float64 else tf.bfloat16 if args.bfloat16 else tf.float32
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    exchange = Exchange(average=not args.sum, compression=hvd.Compression.fp16 if args.fp16 else None)
    dense, sparse = gradients_of(rank, dtype.as_numpy_dtype)

    variables = [tf.Variable(tf.zeros(d.shape, dtype)) for d in dense]
    variables += [tf.Variable(tf.zeros(shape, dtype)) for _, _, shape in sparse] + [tf.Variable(0.0)]
    signature = [tf.TensorSpec([None, *dense[0].shape[1:]], dtype)]
    signature += [tf.TensorSpec(d.shape, dtype) for d in dense[1:]]
    signature += [spec for _, rows, (_, dim) in sparse for spec in (tf.TensorSpec([None], tf.int32),
                                                                    tf.TensorSpec([None, dim], dtype))]
    signature.append(tf.TensorSpec([2], tf.int64))

    @tf.function(input_signature=signature)
    def step(*flat):
        grads = list(flat[:len(dense)])
        for k, (_, _, shape) in enumerate(sparse):
            ids, rows = flat[len(dense) + 2 * k], flat[len(dense) + 2 * k + 1]
            dense_shape = flat[-1] if k == len(sparse) - 1 else tf.constant(shape, tf.int64)
            grads.append(tf.IndexedSlices(rows, ids, dense_shape))
        out = exchange(grads + [None], variables)
        assert out[-1] is None
        flat_out = []
        for g in out[:-1]:
            flat_out += [g.values, g.indices] if isinstance(g, tf.IndexedSlices) else [g]
        return flat_out, exchange.choices

    inputs = [tf.constant(d) for d in dense] + [tf.constant(a) for ids, rows, _ in sparse for a in (ids, rows)]
    inputs.append(tf.constant(sparse[-1][2], tf.int64))
    flat_out, choices = step(*inputs)
    every = [gradients_of(r, dtype.as_numpy_dtype) for r in range(size)]
    divisor = 1.0 if args.sum else size
    gaps, unique = [], []
    for j in range(len(dense)):
        expected = sum(e[0][j].astype(np.float64) for e in every) / divisor
        gaps.append(float(np.max(np.abs(flat_out[j].numpy() - expected)) / np.max(np.abs(expected))))
    for k, (_, _, shape) in enumerate(sparse):
        values, indices = flat_out[len(dense) + 2 * k].numpy(), flat_out[len(dense) + 2 * k + 1].numpy()
        touched = set().union(*(e[1][k][0].tolist() for e in every))
        unique.append(len(set(indices.tolist())) == len(indices) and set(indices.tolist()) == touched)
        expected = sum(as_dense(*e[1][k]) for e in every) / divisor
        got = as_dense(indices, values, shape)
        gaps.append(float(np.max(np.abs(got - expected)) / np.max(np.abs(expected))))
    print(json.dumps({"rank": rank, "gaps": gaps, "gathered": [bool(c) for c in choices],
                      "unique_ids": unique, "dtypes": [t.dtype.name for t in flat_out]}), flush=True)


if __name__ == "__main__":
    main()
