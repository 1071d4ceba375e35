"""Every loss and metric with real ranks: N ranks on uneven local batches == one process on the
global batch (weights to 1e-5), and the metrics' global sums are those of one process exactly."""
import numpy as np
import pytest

from tests.helpers.oracle import assert_same_weights
from tests.helpers.ranks import run_ranks
from tests.workers.objectives import CASES

STEPS = 10


def run_cases(tmp_path, tag, np_, sizes, launcher):
    out = tmp_path / f"{tag}.npz"
    run_ranks(np_, ["-m", "tests.workers.objectives", str(out), sizes, str(STEPS), ",".join(CASES)],
              launcher=launcher, timeout=600)
    return [dict(np.load(tmp_path / f"{tag}.rank{rank}.npz")) for rank in range(np_)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("objectives")
    return run_cases(tmp_path, "ranks", 2, "5,27", "gloo"), run_cases(tmp_path, "oracle", 1, "32", "single")[0]


@pytest.mark.parametrize("case", CASES)
def test_every_loss_trains_at_two_ranks_as_one_process_on_the_global_batch(runs, case):
    """10 steps at local batches 5 + 27 == one process at 32: label-smoothed cross-entropy,
    multi-label binary cross-entropy, mean squared error, per-pixel cross-entropy of a U-Net with
    synchronized BatchNorm, and a user's Adam on a Keras CosineDecay schedule object. The
    weights moved (the loss is no no-op)."""
    ranks, oracle = runs
    for rank in (0, 1):
        assert_same_weights(ranks[rank], oracle, prefix=f"{case}/final/")
    moved = [k for k in oracle if k.startswith(f"{case}/final/") and oracle[k].ndim >= 2
             and not np.allclose(oracle[k], oracle[k.replace("/final/", "/initial/")])]
    assert moved, f"{case}: training left every kernel as it was"
    train, train_oracle = ranks[0][f"{case}/train_sums"], oracle[f"{case}/train_sums"]
    assert train[1] == train_oracle[1] == 320  # examples
    assert train[0] == pytest.approx(train_oracle[0], rel=1e-5)  # the loss sum


@pytest.mark.parametrize("case", CASES)
def test_metric_sums_over_uneven_shards_equal_one_process_exactly(runs, case):
    """The same model (the broadcast initial one) evaluated over 37 test examples split 19 + 18
    between the ranks gives the global sums of one process: every count, and for mean IoU the
    whole confusion matrix, equal exactly; the loss sum to float32 rounding (a batch's float32
    outputs depend on its size, through the kernels' blocking)."""
    ranks, oracle = runs
    ours, theirs = ranks[0][f"{case}/initial_eval"], oracle[f"{case}/initial_eval"]
    np.testing.assert_array_equal(ranks[1][f"{case}/initial_eval"], ours)  # every rank has the global sums
    assert ours[0] == pytest.approx(theirs[0], rel=1e-6)
    np.testing.assert_array_equal(ours[1:], theirs[1:])
    if case == "segmentation":  # a confusion matrix of 11 x 11 with predictions off the diagonal
        matrix = ours[4:].reshape(11, 11)
        assert matrix.sum() == 37 * 64 and np.count_nonzero(matrix - np.diag(np.diag(matrix)))
