"""The reference workloads of examples/ at two ranks, each a Keras model object trained by its own
step: a Transformer text classifier (ragged token ids; raw strings through TextVectorization), a
recommender with dict inputs and two heads, keras.io's distiller, and a GAN with two optimizers."""
import json

import pytest

from tests.helpers.kerases import needs_keras3
from tests.helpers.ranks import run_ranks

pytestmark = needs_keras3


def _history(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("strings", [False, True])
def test_the_text_classifier_learns_the_reviews_sentiment(tmp_path, strings):
    result = run_ranks(2, ["examples/text_classifier.py", "--train", "1000", "--test", "300", "--epochs", "2",
                           "--log-dir", str(tmp_path), *(["--strings"] if strings else [])], timeout=400)
    assert "step:  Keras' default train_step" in result.stdout
    assert ("x string ()" if strings else "x int32 (None)") in result.stdout
    history = _history(tmp_path)
    assert history[-1]["world_size"] == 2 and history[-1]["train_examples"] == 1000
    assert history[-1]["test_accuracy"] > 0.9  # chance is 0.5: a sentiment word anywhere decides


def test_the_recommender_learns_both_heads(tmp_path):
    run_ranks(2, ["examples/recommender.py", "--train", "4000", "--test", "1000", "--epochs", "3",
                  "--log-dir", str(tmp_path)], timeout=400)
    first, last = _history(tmp_path)[0], _history(tmp_path)[-1]
    assert last["test_rating_mae"] < first["test_rating_mae"] and last["test_loss"] < first["test_loss"]
    assert {"test_click_accuracy", "test_rating_loss", "test_click_loss"} <= set(last)


def test_the_distiller_trains_with_its_own_compile_and_compute_loss(tmp_path):
    result = run_ranks(2, ["examples/distillation.py", "--train", "2000", "--test", "1000", "--epochs", "2",
                           "--log-dir", str(tmp_path)], timeout=400)
    assert "Keras' default train_step with Distiller.compute_loss (the model's own)" in result.stdout
    student = _history(tmp_path / "student")
    assert student[-1]["test_accuracy"] > 0.3  # chance is 0.1
    assert (tmp_path / "student" / "model.weights.h5").exists()  # a subclassed model Keras cannot save whole


def test_the_gan_steps_both_optimizers_on_images_alone(tmp_path):
    result = run_ranks(2, ["examples/gan.py", "--train", "2000", "--epochs", "2", "--log-dir", str(tmp_path)],
                       timeout=400)
    assert "GAN.train_step (the model's own); 2 optimizer(s)" in result.stdout
    history = _history(tmp_path)
    assert all(k in history[-1] for k in ("train_d_loss", "train_g_loss")) and "test_loss" not in history[-1]
    assert "  test" not in result.stdout  # no test set: no empty test column
