"""A Keras model object trained by its own step (hvdtrain.keras_step, hvdtrain.keras_recipe): the oracle
(np=2 at local batch 8 equals one process at 16, to 1e-5 per weight tensor, with an uneven last
global batch) for dict inputs with token ids and two outputs with loss weights, sample weights,
class weights, a model's own train_step and a two-optimizer step, in Keras 2 and Keras 3; the
global metrics agree to the printed digit; fit runs case after case in one process, and Horovod
is usable after it (tests/workers/own_steps.py)."""
import json

import numpy as np
import pytest

from tests.helpers.kerases import needs_keras3
from tests.helpers.oracle import assert_same_weights
from tests.helpers.ranks import run_ranks

CASES = ["dict-two-outputs", "sample-weights", "class-weights", "own-train-step", "two-optimizers"]


def _train(out, np_, keras, batch, cases):
    out.mkdir()
    launcher = "gloo" if np_ > 1 else "single"
    run_ranks(np_, ["tests/workers/own_steps.py", str(out), str(keras), str(batch), ",".join(cases)],
              launcher=launcher, timeout=400)
    return out


@pytest.mark.parametrize("keras", [2, pytest.param(3, marks=needs_keras3)])
def test_two_ranks_equal_one_process_on_the_global_batch(tmp_path, keras):
    ranks = _train(tmp_path / "np2", 2, keras, 8, CASES)
    oracle = _train(tmp_path / "np1", 1, keras, 16, CASES)
    for case in CASES:
        ours = dict(np.load(ranks / f"{case}.rank0.npz"))
        other = dict(np.load(ranks / f"{case}.rank1.npz"))
        expected = dict(np.load(oracle / f"{case}.rank0.npz"))
        try:
            assert_same_weights(ours, expected)
        except AssertionError as e:
            raise AssertionError(f"{case}: {e}") from None
        for key in ours:  # every weight alike on both ranks, Keras 2's metric trackers included
            np.testing.assert_array_equal(ours[key], other[key], err_msg=f"{case}: {key}")
        ran = json.loads((ranks / f"{case}.rank0.json").read_text())
        alone = json.loads((oracle / f"{case}.rank0.json").read_text())
        assert ran["world_size"] == 2 and alone["world_size"] == 1
        metrics = [k for k in alone["history"][-1] if k.startswith(("train_", "test_")) and k != "train_examples"]
        assert metrics, case
        for key in metrics:  # exact global metrics: sums allreduced, each output's loss weighed by its batch
            assert ran["history"][-1][key] == pytest.approx(alone["history"][-1][key], rel=1e-5, abs=1e-6), (case, key)
        assert ran["history"][-1]["train_examples"] == 100


@pytest.mark.parametrize("keras", [2, pytest.param(3, marks=needs_keras3)])
def test_a_resumed_run_of_two_optimizers_continues_exactly(tmp_path, keras):
    """Both optimizers' state (momentum in each) is in the checkpoint: 1 epoch, then a new job resuming for
    the second, ends bit for bit where 2 epochs in one job end."""
    straight = _train(tmp_path / "straight", 2, keras, 8, ["two-optimizers"])
    (tmp_path / "resumed").mkdir()
    for epochs, extra in (("1", []), ("2", ["resume"])):
        run_ranks(2, ["tests/workers/own_steps.py", str(tmp_path / "resumed"), str(keras), "8", "two-optimizers",
                      epochs, *extra], timeout=400)
    ours, theirs = (dict(np.load(d / "two-optimizers.rank0.npz")) for d in (tmp_path / "resumed", straight))
    for key in theirs:
        if key.startswith("final/"):
            np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)


@pytest.mark.parametrize("mode, message", [
    ("label-key", "the labels name output(s) 'score' that the model does not have (its outputs: cls, reg)"),
    ("loss-key", "the loss name output(s) 'score' that the model does not have (its outputs: cls, reg)"),
    ("rank-data", "rank 1 loaded other data than rank 0 (digest.train x['num']: "),
    ("class-weight", "class_weight names class(es) [5] that no training label holds (the labels hold 0..0)"),
])
def test_bad_input_to_a_model_object_stops_every_rank_with_one_error_naming_it(tmp_path, mode, message):
    result = run_ranks(2, ["tests/workers/own_step_errors.py", str(tmp_path / "run"), mode], check=False,
                       timeout=200)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "run" / "model.keras").exists()
