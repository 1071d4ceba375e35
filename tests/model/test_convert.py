"""convert_sync_batchnorm: every Keras BatchNormalization becomes SyncBatchNormalization with the same
configuration and weights, in Sequential, functional, subclassed, nested and keras.applications models."""
import numpy as np
import pytest
import tensorflow as tf

from hvdtrain import convert_sync_batchnorm
from hvdtrain.keras2 import SyncBatchNormalization
from hvdtrain.errors import HvdtrainError
from hvdtrain.model.convert import keras_batch_norm_layers

X = np.random.default_rng(0).random((4, 8, 8, 3)).astype(np.float32)


def _trained_statistics(model):
    """Moving statistics away from their initial values, so that copying them is tested."""
    for _ in range(3):
        model(X * 3.0 + 1.0, training=True)
    return model


def _same_model(before, after):
    assert not keras_batch_norm_layers(after)
    np.testing.assert_allclose(after(X, training=False), before(X, training=False), rtol=1e-6, atol=1e-6)


def _conv_bn():
    return [tf.keras.layers.Conv2D(4, 3), tf.keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-4,
                                                                               gamma_regularizer="l2")]


def test_sequential():
    model = _trained_statistics(tf.keras.Sequential([tf.keras.Input((8, 8, 3)), *_conv_bn()]))
    before = model(X, training=False)
    converted = convert_sync_batchnorm(model)
    _same_model(model, converted)
    [layer] = [m for m in converted.submodules if isinstance(m, SyncBatchNormalization)]
    assert (layer.momentum, layer.epsilon, layer.name) == (0.9, 1e-4, model.layers[1].name)
    assert layer.gamma_regularizer is not None and layer.synchronized
    # Keras' fused kernel (4-D inputs) tracks the unbiased variance: so does the converted layer.
    assert layer.unbiased_moving_variance
    np.testing.assert_array_equal(model(X, training=False), before)  # the original is untouched


def test_functional_nested_and_shared_layers():
    inputs = tf.keras.Input((8, 8, 3))
    inner = tf.keras.Sequential([tf.keras.Input((8, 8, 3)), *_conv_bn()], name="inner")
    x = tf.keras.layers.BatchNormalization()(inputs)
    y = tf.keras.layers.GlobalAveragePooling2D()(inner(x))
    model = _trained_statistics(tf.keras.Model(inputs, tf.keras.layers.Dense(2)(y)))
    converted = convert_sync_batchnorm(model)
    _same_model(model, converted)
    assert sum(isinstance(m, SyncBatchNormalization) for m in converted.submodules) == 2
    dense = model.layers[-1]
    assert any(layer is dense for layer in converted.layers)  # other layers are shared, weights and all


def test_subclassed_model_in_place():
    class Net(tf.keras.Model):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = _conv_bn()
            self.blocks = [tf.keras.layers.BatchNormalization(), tf.keras.layers.ReLU()]
            self.head = {"norm": tf.keras.layers.BatchNormalization()}

        def call(self, x, training=None):
            x = self.blocks[1](self.blocks[0](self.bn(self.conv(x), training=training), training=training))
            return self.head["norm"](x, training=training)

    model = Net()
    model(X)
    _trained_statistics(model)
    before = model(X, training=False)
    converted = convert_sync_batchnorm(model)
    assert converted is model
    np.testing.assert_allclose(converted(X, training=False), before, rtol=1e-6, atol=1e-6)
    assert not keras_batch_norm_layers(converted)
    assert len(converted.trainable_weights) == 2 + 3 * 2  # conv kernel, bias; three gammas and betas


def test_keras_applications_mobilenet_v2():
    model = tf.keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=10,
                                              classifier_activation=None)
    assert len(keras_batch_norm_layers(model)) == 52
    converted = convert_sync_batchnorm(model)
    x = np.random.default_rng(1).random((2, 32, 32, 3)).astype(np.float32)
    np.testing.assert_allclose(converted(x, training=False), model(x, training=False), rtol=1e-5, atol=1e-6)
    assert sum(isinstance(m, SyncBatchNormalization) for m in converted.submodules) == 52
    assert len(converted.weights) == len(model.weights)


def test_a_layer_of_virtual_batches_stays_keras():
    """Virtual batches are groups of a rank's own examples: that layer stays Keras' (each rank's
    virtual batches are one process's where they divide the local batch); the others convert."""
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.BatchNormalization(name="plain"),
                                 tf.keras.layers.BatchNormalization(virtual_batch_size=2, name="ghost")])
    converted = convert_sync_batchnorm(model)
    assert [type(layer).__name__ for layer in converted.layers] == ["SyncBatchNormalization", "BatchNormalization"]
    assert converted.layers[1].virtual_batch_size == 2


def test_what_cannot_be_converted_is_named():
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.BatchNormalization(renorm=True, name="rn")])
    with pytest.raises(HvdtrainError, match="the layer 'rn' uses renorm=True"):
        convert_sync_batchnorm(model)

    class MadeInCall(tf.keras.Model):
        def call(self, x):
            if not hasattr(self, "_hidden"):
                self._hidden = (tf.keras.layers.BatchNormalization(name="hidden"),)  # in a tuple: not replaceable
            return self._hidden[0](x)

    model = MadeInCall()
    model(np.zeros((2, 4), np.float32))
    with pytest.raises(HvdtrainError, match="cannot replace the batch norm layer 'hidden'"):
        convert_sync_batchnorm(model)
    with pytest.raises(HvdtrainError, match="takes a Keras model"):
        convert_sync_batchnorm(tf.keras.layers.Dense(2))
    plain = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2)])
    assert convert_sync_batchnorm(plain) is plain


def test_several_axes():
    """Keras keeps the weights of axis=[1, 3] as (1, 5, 1, 7); the synchronized layer as (5, 7)."""
    model = _trained_statistics(tf.keras.Sequential([tf.keras.Input((8, 8, 3)), tf.keras.layers.Conv2D(7, 3),
                                                     tf.keras.layers.BatchNormalization(axis=[1, 3])]))
    _same_model(model, convert_sync_batchnorm(model))


def test_the_command_line_converts_and_otherwise_warns_once(tmp_path):
    """At 2 ranks a --model with Keras BatchNormalization gets one warning naming the fix; with
    --convert-sync-bn none, and the model trains (synchronized) alike."""
    from tests.helpers.ranks import run_ranks

    args = ["-m", "hvdtrain", "--dataset", "synthetic", "--model", "tests.helpers.models:cnn_keras_bn", "--epochs", "1",
            "--no-progress", "--threads", "1"]
    plain = run_ranks(2, [*args, "--log-dir", str(tmp_path / "plain")])
    assert plain.stderr.count("Keras BatchNormalization layer(s)") == 1 and "--convert-sync-bn" in plain.stderr
    converted = run_ranks(2, [*args, "--convert-sync-bn", "--log-dir", str(tmp_path / "converted")])
    assert "Keras BatchNormalization layer(s)" not in converted.stderr
    assert "convert_sync_bn: true" in (tmp_path / "converted" / "config.yaml").read_text()


def test_a_layer_held_twice_stays_one_layer():
    class Twice(tf.keras.Model):
        def __init__(self):
            super().__init__()
            self.bn = tf.keras.layers.BatchNormalization()
            self.same = self.bn

        def call(self, x, training=None):
            return self.same(self.bn(x, training=training), training=training)

    model = Twice()
    model(np.zeros((2, 4), np.float32))
    convert_sync_batchnorm(model)
    assert model.bn is model.same and len(model.weights) == 4
