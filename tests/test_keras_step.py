"""A Keras model object trained by its own step (hvdtrain.keras_step, hvdtrain.keras_recipe): the oracle
(np=2 at local batch 8 equals one process at 16, to 1e-5 per weight tensor, with an uneven last
global batch, 3 + 2 examples) for dict inputs with token ids and two outputs with loss weights, sample weights,
class weights, a model's own train_step and a two-optimizer step, in Keras 2 and Keras 3; the
global metrics agree to the printed digit; fit runs case after case in one process, and Horovod
is usable after it (tests/workers/own_steps.py)."""
import json

import numpy as np
import pytest

from tests.helpers.kerases import KERAS_3, needs_keras3
from tests.helpers.oracle import assert_same_weights
from tests.helpers.ranks import run_ranks

CASES = ["dict-two-outputs", "sample-weights", "class-weights", "own-train-step", "two-optimizers"]


def _train(out, np_, keras, batch, cases, floatx=None):
    out.mkdir()
    launcher = "gloo" if np_ > 1 else "single"
    run_ranks(np_, ["tests/workers/own_steps.py", str(out), str(keras), str(batch), ",".join(cases)],
              launcher=launcher, timeout=400, env={"OWN_STEPS_FLOATX": floatx})
    return out


@pytest.mark.parametrize("keras", [2, pytest.param(3, marks=needs_keras3)])
def test_two_ranks_equal_one_process_on_the_global_batch(tmp_path, keras):
    """Each case's model in float64 at np=2 x 8 equals one process at 16 to 1e-12 (the oracle's
    float64 tolerance); its metrics (logged as float32 values) to 1e-5."""
    ranks = _train(tmp_path / "np2", 2, keras, 8, CASES, floatx="float64")
    oracle = _train(tmp_path / "np1", 1, keras, 16, CASES, floatx="float64")
    for case in CASES:
        ours = dict(np.load(ranks / f"{case}.rank0.npz"))
        other = dict(np.load(ranks / f"{case}.rank1.npz"))
        expected = dict(np.load(oracle / f"{case}.rank0.npz"))
        try:
            assert_same_weights(ours, expected, dtype=np.float64)
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
        assert ran["history"][-1]["train_examples"] == 101


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
    ("ragged", "Keras' default train_step fails on a batch of 8 examples: ValueError: Input 0 with name 'ids' of "
               "layer 'functional' is incompatible with the layer: expected shape=(None, 4), found shape=(8, 3) "
               "(x['ids']: rows of variable length, zero-padded per batch"),
    ("class-weight", "class_weight names class(es) [5] that no training label holds (the labels hold 0..0)"),
    ("no-loss", "the model is not compiled and fit got no loss=: Keras' default train_step needs one"),
])
def test_bad_input_to_a_model_object_stops_every_rank_with_one_error_naming_it(tmp_path, mode, message):
    result = run_ranks(2, ["tests/workers/own_step_errors.py", str(tmp_path / "run"), mode], check=False,
                       timeout=200)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "run" / "model.keras").exists()


def test_an_epoch_whose_last_example_joins_the_step_before_trains_without_a_hang(tmp_path):
    """97 examples at 2 x 8: the last step is 9 + 8, so one rank traces its step anew and the other
    does not; Horovod's collectives must still pair up (named from the graph, alike in both traces)."""
    out = tmp_path / "run"
    out.mkdir()
    run_ranks(2, ["tests/workers/own_steps.py", str(out), "3" if KERAS_3 else "2", "8", "two-optimizers"],
              env={"OWN_STEPS_EXAMPLES": "97"}, timeout=200)
    ranks = [dict(np.load(out / f"two-optimizers.rank{r}.npz")) for r in (0, 1)]
    for key in ranks[0]:
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=key)
    assert json.loads((out / "two-optimizers.rank0.json").read_text())["history"][-1]["train_examples"] == 97


def test_each_rank_draws_its_own_random_numbers_after_the_broadcast():
    """Keras 3's seed generators hold rank 0's state after the broadcast: rank r's seed moves by r * 1,000,003."""
    from hvdtrain.keras_step import separate_random_streams

    if not KERAS_3:
        pytest.skip("needs Keras 3")
    import keras

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dropout(0.5, seed=7)])
    [state] = [v for v in model.variables if "seed_generator_state" in v.path]
    before = state.numpy().copy()
    separate_random_streams(model, seed=0, rank=0)
    np.testing.assert_array_equal(state.numpy(), before)  # rank 0 draws what one process would
    separate_random_streams(model, seed=0, rank=2)
    np.testing.assert_array_equal(state.numpy(), before + [2 * 1_000_003, 0])


def test_fit_replaces_what_it_names_of_a_compiled_model_and_keeps_the_rest(tmp_path):
    """compile(adam, mse, metrics=[mae]), then fit(optimizer=SGD): SGD trains, the loss and mae stay."""
    script = tmp_path / "recompile.py"
    script.write_text(
        "import json, sys, keras, numpy as np, hvdtrain\n"
        "model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])\n"
        "model.compile('adam', loss='mse', metrics=['mae'])\n"
        "x = np.random.default_rng(0).normal(size=(40, 3)).astype('float32')\n"
        "r = hvdtrain.fit(model, x=x, y=x.sum(1, keepdims=True), optimizer=keras.optimizers.SGD(0.05), epochs=1,\n"
        "                 batch_size=8, log={'dir': sys.argv[1], 'progress': False})\n"
        "print(json.dumps({'optimizer': type(r.model.optimizer).__name__, 'keys': sorted(r.history[-1])}))\n")
    result = run_ranks(1, [str(script), str(tmp_path / "run")], launcher="single", timeout=200)
    ran = json.loads(result.stdout.strip().splitlines()[-1])
    assert ran["optimizer"] == "SGD" and {"train_loss", "train_mae"} <= set(ran["keys"])
