"""Metrics as sums: the value of summed sums is the metric over all examples, as Keras computes it."""
import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.config import CLASSES, TARGETS
from hvdtrain.errors import HvdtrainError
from hvdtrain.losses import get_loss
from hvdtrain.metrics import Accuracy, MeanIoU, MeanOf, TopKAccuracy, get_metric
from hvdtrain.task import Objective

RNG = np.random.default_rng(1)


def halves_and_whole(metric, labels, outputs):
    """The metric of the two halves' summed sums, of the whole batch, and the mean of the halves' values."""
    first = metric.sums(labels[:3], outputs[:3]).numpy()
    second = metric.sums(labels[3:], outputs[3:]).numpy()
    whole = metric.sums(labels, outputs).numpy()
    np.testing.assert_allclose(first + second, whole)
    return metric.result(first + second), (metric.result(first) + metric.result(second)) / 2


def test_mean_iou_of_summed_confusion_matrices_is_keras_mean_iou_over_all_pixels():
    labels = tf.constant(RNG.integers(0, 4, (8, 6, 6)), tf.int32)
    logits = tf.constant(RNG.normal(size=(8, 6, 6, 4)) + 2 * tf.one_hot(labels, 4).numpy(), tf.float32)
    keras = tf.keras.metrics.MeanIoU(4)
    keras.update_state(labels, tf.argmax(logits, -1))
    exact, averaged = halves_and_whole(MeanIoU(4), labels, logits)
    assert exact == pytest.approx(float(keras.result()), rel=1e-6)
    assert averaged != pytest.approx(exact, rel=1e-6)  # why the ranks' IoUs are not averaged


def test_mean_iou_leaves_out_classes_absent_from_labels_and_predictions():
    metric = MeanIoU(3)
    sums = metric.sums(tf.constant([0, 0, 1]), tf.one_hot([0, 1, 1], 3)).numpy()
    assert metric.result(sums) == pytest.approx((1 / 2 + 1 / 2) / 2)  # class 2 never occurs


def test_top5_and_accuracy_are_keras_metrics():
    labels = tf.constant(RNG.integers(0, 10, 6), tf.int32)
    logits = tf.constant(RNG.normal(size=(6, 10)), tf.float32)
    top5 = tf.keras.metrics.SparseTopKCategoricalAccuracy(5)
    top5.update_state(labels, logits)
    assert halves_and_whole(TopKAccuracy(5), labels, logits)[0] == pytest.approx(float(top5.result()))
    accuracy = tf.keras.metrics.SparseCategoricalAccuracy()
    accuracy.update_state(labels, logits)
    assert halves_and_whole(Accuracy(), labels, logits)[0] == pytest.approx(float(accuracy.result()))


def test_multi_label_accuracy_is_keras_binary_accuracy_of_the_logits_sign():
    targets = tf.constant(RNG.integers(0, 2, (6, 4)), tf.float32)
    logits = tf.constant(RNG.normal(size=(6, 4)), tf.float32)
    keras = tf.keras.metrics.BinaryAccuracy(threshold=0.5)
    keras.update_state(targets, tf.sigmoid(logits))
    assert halves_and_whole(Accuracy(multi_label=True), targets, logits)[0] == pytest.approx(float(keras.result()))


def test_objective_sums_the_loss_the_examples_and_each_metric_in_one_vector():
    objective = Objective(get_loss("sparse_categorical_crossentropy"), [Accuracy(), MeanOf("first", lambda y, o: o[:, 0])])
    labels, logits = tf.constant([0, 1, 1]), tf.constant([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]])
    losses, sums = objective(labels, logits)
    assert objective.size == sums.shape[0] == 6 and objective.names == ["loss", "accuracy", "first"]
    results = objective.results(sums.numpy())
    assert results == pytest.approx({"loss": float(tf.reduce_mean(losses)), "accuracy": 2 / 3, "first": 5 / 3,
                                     "count": 3})


@pytest.mark.parametrize("name, loss, labels, classes, message", [
    ("f1", "sparse_categorical_crossentropy", CLASSES, 10, "--metrics 'f1': unknown metric"),
    ("top5", "sparse_categorical_crossentropy", CLASSES, 5, "--metrics top5: the labels have 5 classes"),
    ("mean_iou", "mse", TARGETS, 3, "--metrics mean_iou: needs class-index labels, but the loss mse takes targets"),
])
def test_metrics_that_do_not_fit_are_refused_by_name(name, loss, labels, classes, message):
    with pytest.raises(HvdtrainError, match=message):
        get_metric(name, get_loss(loss), labels, classes)


def test_two_metrics_of_one_name_are_refused():
    with pytest.raises(HvdtrainError, match="metric names must differ"):
        Objective(get_loss("mse"), [MeanOf("loss", lambda y, o: o)])


def test_a_resumed_epochs_sums_must_be_of_the_same_loss_and_metrics():
    from hvdtrain.errors import EveryRankError
    from hvdtrain.position import TrainPosition

    objective = Objective(get_loss("sparse_categorical_crossentropy"), [TopKAccuracy(5)])
    assert objective.layout == ("sparse_categorical_crossentropy", "top5:2")
    np.testing.assert_array_equal(objective.start_sums(TrainPosition(0, 3, 96, (1, 96, 50, 96), objective.layout)),
                                  [1, 96, 50, 96])
    np.testing.assert_array_equal(objective.start_sums(None), np.zeros(4))
    accuracy = TrainPosition(0, 3, 96, (1, 96, 80, 96), ("sparse_categorical_crossentropy", "accuracy:2"))
    with pytest.raises(EveryRankError, match="holds the sums of another loss or other metrics \\(sparse_categorical_"
                                             "crossentropy, accuracy:2, where this run has sparse_categorical_"
                                             "crossentropy, top5:2\\)"):
        objective.start_sums(accuracy)  # as many numbers, counting something else


def test_check_names_a_loss_or_metric_that_fails_before_training():
    labels, logits = tf.zeros((2,), tf.int32), tf.zeros((2, 10))
    Objective(get_loss("sparse_categorical_crossentropy"), [Accuracy(), TopKAccuracy(5)]).check(labels, logits)
    with pytest.raises(HvdtrainError, match="the metric mean returned one value for the whole batch"):
        Objective(get_loss("sparse_categorical_crossentropy"), [MeanOf("mean", lambda y, o: tf.reduce_mean(o))]).check(
            labels, logits)
    with pytest.raises(HvdtrainError, match=r"the metric broken fails on labels \(2,\) int32 and outputs \(2, 10\): "
                                            r"ZeroDivisionError"):
        Objective(get_loss("sparse_categorical_crossentropy"), [MeanOf("broken", lambda y, o: 1 / 0)]).check(labels, logits)
