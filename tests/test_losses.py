"""Losses: one loss per example, equal to Keras' own; named, Keras and callable losses."""
import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.errors import HvdtrainError
from hvdtrain.losses import CLASSES, TARGETS, get_loss

RNG = np.random.default_rng(0)
LOGITS = tf.constant(RNG.normal(size=(6, 5)), tf.float32)
CLASS_LABELS = tf.constant(RNG.integers(0, 5, 6), tf.int32)
TARGET_VALUES = tf.constant(RNG.uniform(size=(6, 5)), tf.float32)


def test_label_smoothing_is_keras_categorical_crossentropy_of_the_one_hot_labels():
    ours = get_loss("sparse_categorical_crossentropy", 0.1)(CLASS_LABELS, LOGITS)
    keras = tf.keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.1, reduction="none")(
        tf.one_hot(CLASS_LABELS, 5), LOGITS)
    assert ours.shape == (6,)
    np.testing.assert_allclose(ours, keras, rtol=1e-6)
    plain = get_loss("sparse_categorical_crossentropy")(CLASS_LABELS, LOGITS)
    assert not np.allclose(ours, plain)


@pytest.mark.parametrize("name, keras", [
    ("binary_crossentropy", tf.keras.losses.BinaryCrossentropy(from_logits=True, label_smoothing=0.2, reduction="none")),
    ("mse", tf.keras.losses.MeanSquaredError(reduction="none")),
])
def test_target_losses_are_keras_per_example(name, keras):
    loss = get_loss(name, 0.2 if name == "binary_crossentropy" else 0.0)
    assert loss.labels == TARGETS
    np.testing.assert_allclose(loss(TARGET_VALUES, LOGITS), keras(TARGET_VALUES, LOGITS), rtol=1e-6)


def test_dense_outputs_give_the_mean_over_each_examples_pixels():
    logits = tf.constant(RNG.normal(size=(3, 4, 4, 5)), tf.float32)
    labels = tf.constant(RNG.integers(0, 5, (3, 4, 4)), tf.int32)
    per_pixel = tf.keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
    ours = get_loss("sparse_categorical_crossentropy")(labels, logits)
    np.testing.assert_allclose(ours, tf.reduce_mean(per_pixel, [1, 2]), rtol=1e-6)


def test_keras_loss_objects_and_callables_give_one_loss_per_example():
    keras = get_loss(tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))  # its reduction is not used
    assert keras.labels == CLASSES and keras(CLASS_LABELS, LOGITS).shape == (6,)
    np.testing.assert_allclose(keras(CLASS_LABELS, LOGITS), get_loss("sparse_categorical_crossentropy")(
        CLASS_LABELS, LOGITS), rtol=1e-6)
    assert get_loss(tf.keras.losses.Huber()).labels == TARGETS

    def abs_error(labels, outputs):
        return tf.abs(outputs - labels)  # per element: reduced to the mean per example

    loss = get_loss(abs_error)
    assert loss.name == "abs_error" and loss.labels is None
    np.testing.assert_allclose(loss(TARGET_VALUES, LOGITS), tf.reduce_mean(tf.abs(LOGITS - TARGET_VALUES), 1), rtol=1e-6)


@pytest.mark.parametrize("spec, smoothing, message", [
    ("hinge", 0.0, "--loss 'hinge': unknown loss"),
    (tf.keras.losses.SparseCategoricalCrossentropy(), 0.0, "but the models give logits: pass from_logits=True"),
    ("mse", 0.1, "--label-smoothing applies to sparse_categorical_crossentropy and binary_crossentropy, not mse"),
    (3, 0.0, "loss must be one of"),
])
def test_bad_losses_are_refused_by_name(spec, smoothing, message):
    with pytest.raises(HvdtrainError, match=message.replace("(", r"\(")):
        get_loss(spec, smoothing)


def test_a_batch_mean_is_refused_naming_the_loss():
    def batch_mean(labels, outputs):
        return tf.reduce_mean(tf.square(outputs - labels))

    with pytest.raises(HvdtrainError, match="the loss batch_mean returned one value for the whole batch"):
        get_loss(batch_mean)(TARGET_VALUES, LOGITS)
