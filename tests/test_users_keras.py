"""A user's own Keras script at two ranks (tests/workers/users_keras.py): TensorFlow used before
hvdtrain, their optimizer built first, tf.data datasets, Keras BatchNormalization converted, stock
Keras callbacks, a data function in the script itself; what the run leaves (model.keras, curves.png)."""
import csv
import json

import pytest

from tests.helpers.ranks import run_ranks
from tests.helpers.kerases import needs_keras3

SEEN_ALIKE = ("loss", "accuracy", "val_loss", "val_accuracy", "lr", "learning_rate")


def _run(tmp_path, mode, keras):
    result = run_ranks(2, ["tests/workers/users_keras.py", str(tmp_path), mode, str(keras)], timeout=400)
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    return result, reports


@pytest.mark.parametrize("mode, keras", [("callbacks", 2), ("stop-on-rank-1", 2), ("data-function", 2),
                                         pytest.param("callbacks", 3, marks=needs_keras3),
                                         pytest.param("stop-on-rank-1", 3, marks=needs_keras3)])
def test_a_users_keras_script_trains_at_two_ranks(tmp_path, mode, keras):
    """The same script in Keras 2 (tf.keras after `import hvdtrain`) and Keras 3 (`import keras`)."""
    result, (rank0, rank1) = _run(tmp_path, mode, keras)
    assert keras == 2 or rank0["model_keras"] == "keras"  # Keras 3's package
    # Keras' BatchNormalization was converted (convert_sync_bn=True), so no per-rank warning.
    assert (rank0["sync_layers"], rank0["keras_layers"]) == (1, 0)
    assert "Keras BatchNormalization layer(s)" not in result.stderr
    # The callbacks saw the global metrics under Keras' names, alike on both ranks.
    for seen in (rank0["keras_logs"], rank1["keras_logs"]):
        assert set(SEEN_ALIKE) <= set(seen[-1])
    assert [{k: e[k] for k in SEEN_ALIKE} for e in rank0["keras_logs"]] == \
        [{k: e[k] for k in SEEN_ALIKE} for e in rank1["keras_logs"]]
    assert [e["val_loss"] for e in rank0["keras_logs"]] == [h["test_loss"] for h in rank0["history"]]
    # What the run leaves, from rank 0: the trained model (reloaded, the same predictions) and its curves.
    assert rank0["loaded_max_diff"] == 0.0 and rank0["loaded_keras"] == rank0["model_keras"]
    assert (tmp_path / "run" / "curves.png").stat().st_size > 1000
    trained = len(rank0["history"])
    assert trained == len(rank1["history"])
    if mode == "callbacks":
        # EarlyStopping(baseline unreachable, patience 2) stops every rank after epoch 2 of 4.
        assert trained == 2 and "a callback stopped training after epoch 2 of 4" in result.stdout
        rows = list(csv.DictReader((tmp_path / "log.csv").open()))  # CSVLogger, from rank 0 alone
        assert [int(r["epoch"]) for r in rows] == [0, 1]
        assert float(rows[1]["val_loss"]) == pytest.approx(rank0["history"][1]["test_loss"])
        assert (tmp_path / "model.weights.h5").exists()  # ModelCheckpoint
        # ReduceLROnPlateau (min_delta unreachable, patience 0) halved the rate after epoch 2, on both ranks.
        assert rank0["history"][1]["lr"] == pytest.approx(0.05)
        assert rank0["final_lr"] == rank1["final_lr"] == pytest.approx(0.025)
    elif mode == "stop-on-rank-1":
        # model.stop_training set on rank 1 alone: both ranks stop after the same epoch, no hang.
        assert trained == 1 and "a callback stopped training after epoch 1 of 4" in result.stdout
    else:
        # The data function named from the script itself was not imported again (which would
        # run the script's fit twice).
        assert trained == 4 and "data:users_keras:make_data" in result.stdout
        assert result.stdout.count("fit done on rank 0") == 1


def test_a_refused_keras_callback_fails_every_rank_and_closes_what_was_opened(tmp_path):
    """Keras' TensorBoard is refused (hvdtrain writes its own) before training: rank 0 raises why,
    the other ranks that rank 0 failed; rank 0's callbacks, opened just before, are closed all the same."""
    run_ranks(2, ["tests/workers/refused_keras_callback.py", str(tmp_path)], timeout=300)
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert "Keras' callbacks.TensorBoard is not supported" in reports[0]["error"], reports
    assert reports[1]["error"] == "rank 0 failed while setting up the Keras callbacks; that rank reports why"
    assert [r["closed"] for r in reports] == [True, False]  # chief-only: rank 0's alone
    assert not (tmp_path / "board").exists() and not (tmp_path / "run" / "model.keras").exists()
