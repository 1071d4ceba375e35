"""hvdtrain.exchange: fixed buckets, the bytes of each sparse exchange, and, at 2 and 3 real ranks,
the exchanged gradients against their dense average (tests/workers/exchange_cases.py)."""
import json

import pytest
import tensorflow as tf

from hvdtrain.exchange import BUCKET_CAP_BYTES, bucket_cap_bytes, buckets, dense_bytes, sparse_bytes
from tests.helpers.ranks import run_ranks


def test_buckets_run_backwards_one_dtype_each_and_close_at_the_cap():
    tensors = [tf.zeros([10], tf.float32), tf.zeros([4], tf.float64), tf.zeros([20], tf.float32),
               tf.zeros([5], tf.float32), tf.zeros([6], tf.float64)]
    # 4 bytes a float32: [3] 20 B and [2] 80 B fill 100 B; [0] 40 B opens the next one.
    assert buckets(tensors, cap_bytes=100) == [[4, 1], [3, 2], [0]]
    assert buckets(tensors, cap_bytes=0) == [[4], [3], [2], [1], [0]]
    assert buckets(tensors, cap_bytes=10 ** 9) == [[4, 1], [3, 2, 0]]


def test_a_gradient_without_a_static_shape_is_refused_by_name():
    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
    def bucket(t):
        return buckets([t], 100)

    with pytest.raises(ValueError, match=r"a dense gradient needs a static shape to be bucketed, got \(None,\)"):
        bucket.get_concrete_function()


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


@pytest.mark.parametrize("np_, flags", [(2, []), (3, []), (3, ["--fp16"]), (2, ["--sum"])],
                         ids=["np2", "np3", "np3-fp16", "np2-sum"])
def test_exchanged_gradients_equal_their_dense_average(np_, flags):
    """Duplicate ids, a rank touching no row, a table the dense allreduce is cheaper for: within 1e-6
    of the float64 average (fp16 compression: within its rounding, and visibly rounded, sparse values too)."""
    result = run_ranks(np_, ["tests/workers/exchange_cases.py", *flags], timeout=300)
    reports = [json.loads(line.split(">:", 1)[-1]) for line in result.stdout.splitlines() if '"rank"' in line]
    assert sorted(r["rank"] for r in reports) == list(range(np_))
    for report in reports:
        # wide: few rows of 20,000 (allgather); narrow: every row of 6 (dense); untouched on rank 1: allgather.
        assert report["gathered"] == [True, False, True]
        assert all(report["unique_ids"]), report
        if "--fp16" in flags:
            assert all(1e-6 < gap < 2e-3 for gap in report["gaps"]), report
        else:
            assert max(report["gaps"]) < 1e-6, report
    assert len({json.dumps(r["gaps"]) for r in reports}) == 1  # the same result on every rank
