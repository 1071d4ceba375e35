"""hvdtrain.exchange: fixed buckets, the bytes of each sparse exchange, and, at 2 and 3 real ranks,
the exchanged gradients against their dense average (tests/workers/exchange_cases.py)."""
import json

import pytest
import tensorflow as tf

from hvdtrain.exchange import (BUCKET_CAP_BYTES, bucket_cap_bytes, buckets, dense_bytes, sparse_bytes, table_bytes,
                               wire_sizes)
from tests.helpers.ranks import run_ranks


def test_buckets_run_backwards_one_dtype_each_and_close_at_the_cap():
    sizes = [40, 32, 80, 20, 48]
    dtypes = [tf.float32, tf.float64, tf.float32, tf.float32, tf.float64]
    # [3] 20 B and [2] 80 B fill 100 B; [0] 40 B opens the next one.
    assert buckets(sizes, dtypes, cap_bytes=100) == [[4, 1], [3, 2], [0]]
    assert buckets(sizes, dtypes, cap_bytes=0) == [[4], [3], [2], [1], [0]]
    assert buckets(sizes, dtypes, cap_bytes=10 ** 9) == [[4, 1], [3, 2, 0]]


def test_a_tensor_of_unknown_size_is_a_bucket_of_its_own():
    sizes = [40, None, 80]
    assert buckets(sizes, [tf.float32] * 3, cap_bytes=10 ** 9) == [[2, 0], [1]]


def test_a_dense_gradient_of_unknown_shape_is_sized_by_its_variable_and_as_horovod_receives_it():
    import horovod.tensorflow as hvd

    variable, sized = tf.Variable(tf.zeros([3, 4])), []

    @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32)])
    def trace(t):
        sized.append(wire_sizes([t, t, tf.zeros([5], tf.float64)], [variable, None, None], hvd.Compression.fp16))
        return t

    trace.get_concrete_function()
    assert sized == [([24, None, 10], [tf.float16] * 3)]  # all three one dtype after compression
    # bfloat16 travels as float32 (no bfloat16 allreduce in Horovod), unless compressed to float16.
    assert wire_sizes([tf.zeros([2], tf.bfloat16)], [None], hvd.Compression.none) == ([8], [tf.float32])
    assert wire_sizes([tf.zeros([2], tf.bfloat16)], [None], hvd.Compression.fp16) == ([4], [tf.float16])


def test_the_cap_is_horovods_fusion_threshold_where_that_is_smaller(monkeypatch):
    monkeypatch.delenv("HOROVOD_FUSION_THRESHOLD", raising=False)
    assert bucket_cap_bytes() == BUCKET_CAP_BYTES
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "1000")
    assert bucket_cap_bytes() == 1000
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "0")
    assert bucket_cap_bytes() == 0


def test_bytes_per_rank_of_the_two_sparse_exchanges():
    # 8 ranks, 1,000 unique rows in all of 64 float32 values and an int64 id: 7/8 of 1000 x 264 B.
    assert sparse_bytes(8, 1000, 64, 4, 8) == 231000
    # The ring allreduce of a 1,000,000 x 64 float32 table: 2 x 7/8 of 256 MB.
    assert dense_bytes(8, 1_000_000, 64, 4) == 448_000_000
    # hvdtrain's dense way adds a column, how many ranks touched each row.
    assert table_bytes(8, 1_000_000, 64, 4) == 455_000_000


@pytest.mark.parametrize("np_, flags", [(2, []), (3, []), (3, ["--fp16"]), (3, ["--sum", "--float64"]),
                                        (3, ["--bfloat16"])],
                         ids=["np2", "np3", "np3-fp16", "np3-sum-float64", "np3-bfloat16"])
def test_exchanged_gradients_equal_their_dense_average(np_, flags):
    """Duplicate ids, a rank touching no row, a table the dense allreduce is cheaper for (which must
    hand back only the touched rows), shapes known only from the variables: within 1e-6 of the float64
    average (fp16 compression: within its rounding, and visibly rounded, sparse values too)."""
    result = run_ranks(np_, ["tests/workers/exchange_cases.py", *flags], timeout=300)
    reports = [json.loads(line.split(">:", 1)[-1]) for line in result.stdout.splitlines() if '"rank"' in line]
    assert sorted(r["rank"] for r in reports) == list(range(np_))
    for report in reports:
        # wide: few rows of 20,000 (allgather); narrow: rows 0-4 of 6 (dense); untouched on rank 1: allgather.
        assert report["gathered"] == [True, False, True]
        assert all(report["unique_ids"]), report  # each touched row once, and no other
        value_dtype = "float64" if "--float64" in flags else "bfloat16" if "--bfloat16" in flags else "float32"
        assert set(report["dtypes"]) == {value_dtype, "int64"}, report
        if "--fp16" in flags:
            assert all(1e-6 < gap < 2e-3 for gap in report["gaps"]), report
        elif "--bfloat16" in flags:  # bfloat16 sums (8 bits of mantissa); Horovod's allreduce has no bfloat16
            assert max(report["gaps"]) < 2e-2, report
        else:
            assert max(report["gaps"]) < 1e-6, report
    assert len({json.dumps(r["gaps"]) for r in reports}) == 1  # the same result on every rank
