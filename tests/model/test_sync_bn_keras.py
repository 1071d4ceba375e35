"""SyncBatchNormalization as a drop-in for Keras' BatchNormalization: what tf-keras's own
``tf_keras/layers/normalization/batch_normalization_test.py`` checks, run against hvdtrain's layer
(one process: world size 1, no collective). Its deliberate differences (TF1 graph mode, renorm,
virtual batches, adjustment, Bessel's correction by default) are in the layer's docstring;
the tests that pin them are marked "deliberate"."""
import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.keras2 import SyncBatchNormalization

Layer = SyncBatchNormalization


def _model(layer, input_shape):
    return tf.keras.Sequential([tf.keras.Input(input_shape), layer])


@pytest.mark.parametrize("kwargs, input_shape", [
    (dict(momentum=0.9, epsilon=0.1, gamma_regularizer=tf.keras.regularizers.l2(0.01),
          beta_regularizer=tf.keras.regularizers.l2(0.01)), (4, 2)),
    (dict(gamma_initializer="ones", beta_initializer="ones", moving_mean_initializer="zeros",
          moving_variance_initializer="ones"), (4, 2)),
    (dict(scale=False, center=False), (3,)),
    (dict(gamma_initializer="ones", beta_initializer="ones"), (2, 4, 2)),
    (dict(fused=True), (3, 3, 3)),
    (dict(fused=None), (3, 3)),
])
def test_basic_batchnorm_config_round_trip_and_training(kwargs, input_shape):
    """Keras' layer_test: output dtype, compute_output_shape, from_config with the weights set gives
    the same predictions, and the layer trains in a compiled model (train_on_batch)."""
    x = (10 * np.random.default_rng(0).random((3, *input_shape)) - 0.5).astype(np.float32)
    model = _model(Layer(**kwargs), input_shape)
    y = model.predict(x, verbose=0)
    assert y.dtype == np.float32 and y.shape == x.shape
    assert tuple(model.layers[0].compute_output_shape((3, *input_shape))) == (3, *input_shape)
    clone = tf.keras.Sequential.from_config(model.get_config(), custom_objects={"SyncBatchNormalization": Layer})
    clone.set_weights(model.get_weights())
    np.testing.assert_allclose(clone.predict(x, verbose=0), y, rtol=1e-6, atol=1e-6)
    model.compile("rmsprop", "mse", weighted_metrics=["acc"])
    model.train_on_batch(x, x)


def test_batchnorm_weights():
    layer = Layer(scale=False, center=False)
    layer.build((None, 3, 4))
    assert (len(layer.trainable_weights), len(layer.weights)) == (0, 2)
    layer = Layer()
    layer.build((None, 3, 4))
    assert (len(layer.trainable_weights), len(layer.weights)) == (2, 4)
    assert [w.name.split("/")[-1] for w in layer.weights] == ["gamma:0", "beta:0", "moving_mean:0",
                                                            "moving_variance:0"]


def test_batchnorm_regularization():
    layer = Layer(gamma_regularizer="l1", beta_regularizer="l1")
    layer.build((None, 3, 4))
    assert len(layer.losses) == 2
    max_norm = tf.keras.constraints.max_norm
    layer = Layer(gamma_constraint=max_norm, beta_constraint=max_norm)
    layer.build((None, 3, 4))
    assert layer.gamma.constraint == max_norm and layer.beta.constraint == max_norm


@pytest.mark.parametrize("axis, input_shape, reduce", [(1, (3, 4, 4), (0, 2, 3)), (-1, (4, 4, 3), (0, 1, 2))])
def test_batchnorm_convnet_normalizes_after_training(axis, input_shape, reduce):
    """Keras' test_batchnorm_convnet and _channel_last: after fitting N(5, 10) data, (out - beta) /
    gamma has mean 0 and std 1 per channel."""
    x = np.random.default_rng(1).normal(5.0, 10.0, (1000, *input_shape))
    model = _model(Layer(axis=axis, momentum=0.8), input_shape)
    model.compile(tf.keras.optimizers.SGD(0.01), "mse")
    model.fit(x, x, epochs=4, batch_size=32, verbose=0)
    layer = model.layers[0]
    shape = [1, 1, 1, 1]
    shape[axis] = 3
    out = (model.predict(x, verbose=0) - np.reshape(layer.beta.numpy(), shape)) / np.reshape(layer.gamma.numpy(), shape)
    np.testing.assert_allclose(out.mean(axis=reduce), 0.0, atol=0.1)
    np.testing.assert_allclose(out.std(axis=reduce), 1.0, atol=0.1)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_batchnorm_correctness(dtype):
    """Keras' _run_batchnorm_correctness_test (fused=False accepted): mean 0 and std 1 after fitting."""
    x = np.random.default_rng(2).normal(5.0, 10.0, (1000, 2, 2, 2)).astype(dtype)
    inputs = tf.keras.Input((2, 2, 2), dtype=dtype)
    outputs = tf.keras.layers.Lambda(lambda t: tf.cast(t, tf.float32))(Layer(momentum=0.8, fused=False)(inputs))
    model = tf.keras.Model(inputs, outputs)
    model.compile(tf.keras.optimizers.SGD(0.01), "mse")
    model.fit(x, x.astype(np.float32), epochs=4, verbose=0)
    layer = model.layers[1]
    out = (model.predict(x, verbose=0) - layer.beta.numpy()) / layer.gamma.numpy()
    assert abs(out.mean()) < 0.2 and abs(out.std() - 1.0) < 0.2


def test_batchnorm_non_trainable_with_fit():
    """A frozen layer (trainable=False) runs in inference mode: training loss equals evaluation loss."""
    inputs = tf.keras.Input((3,))
    model = tf.keras.Model(inputs, Layer()(inputs))
    model.compile("rmsprop", "mse")
    rng = np.random.default_rng(3)
    model.fit(rng.random((100, 3)), rng.random((100, 3)), verbose=0)
    x, y = rng.random((100, 3)), rng.random((100, 3))
    evaluated = model.evaluate(x, y, verbose=0)
    model.layers[1].trainable = False
    model.compile("rmsprop", "mse")
    assert model.train_on_batch(x, y) == pytest.approx(evaluated, abs=1e-6)


def test_moving_statistics_in_a_custom_models_tf_function():
    """Keras' test_eager_batchnorm_in_custom_model_call_with_tf_function: 10 training calls on 0.5."""
    class MyModel(tf.keras.Model):
        def __init__(self):
            super().__init__()
            self.bn = Layer()

        @tf.function
        def call(self, x, training):
            return self.bn(x, training=training)

    model = MyModel()
    for _ in range(10):
        model(tf.constant(0.5, shape=[1, 1]), training=True)
    assert model.bn.moving_mean.numpy() == pytest.approx(0.5 * (1 - 0.99 ** 10), abs=1e-6)
    assert model.bn.moving_variance.numpy() == pytest.approx(0.99 ** 10, abs=1e-6)  # one example: variance 0


def test_shared_batchnorm_in_two_models():
    layer = Layer(input_shape=(10,))
    x1, x2 = tf.keras.Input((10,)), tf.keras.Input((10,))
    layer(x1)
    model = tf.keras.Model(x2, layer(x2))
    model.compile(tf.keras.optimizers.SGD(0.01), "mse")
    data = np.random.default_rng(4).normal(5.0, 10.0, (2, 10))
    model.train_on_batch(data, data)
    x3 = tf.keras.Input((10,))
    outer = tf.keras.Model(x3, model(x3))
    outer.compile(tf.keras.optimizers.SGD(0.01), "mse")
    outer.train_on_batch(data, data)


def test_that_trainable_disables_updates():
    x = np.random.default_rng(5).random((10, 4)).astype(np.float32)
    inputs = tf.keras.Input((4,))
    layer = Layer(input_shape=(4,))
    model = tf.keras.Model(inputs, layer(inputs))
    model.trainable = False
    model.compile("sgd", "mse")
    before = model.predict(x, verbose=0)
    model.train_on_batch(x, x)
    np.testing.assert_allclose(model.predict(x, verbose=0), before, atol=1e-7)
    model.trainable = True
    model.compile("sgd", "mse")
    model.train_on_batch(x, x)
    assert abs(np.sum(model.predict(x, verbose=0) - before)) > 1e-5
    layer.trainable = False
    model.compile("sgd", "mse")
    before = model.predict(x, verbose=0)
    model.train_on_batch(x, x)
    np.testing.assert_allclose(model.predict(x, verbose=0), before, atol=1e-7)


@pytest.mark.parametrize("policy, dtype", [("mixed_float16", tf.float16), ("mixed_bfloat16", tf.bfloat16)])
def test_batchnorm_mixed_precision(policy, dtype):
    """Output in the compute dtype (float inputs cast as Keras casts them, integer inputs too),
    weights and statistics float32."""
    layer = Layer(axis=-1, momentum=0.8, dtype=policy)
    y = layer(np.random.default_rng(6).normal(size=(10, 4, 4, 3)), training=True)
    assert y.dtype == dtype and layer.gamma.dtype == layer.beta.dtype == layer.moving_mean.dtype == tf.float32
    assert layer(np.arange(480).reshape(10, 4, 4, 3), training=True).dtype == dtype


def test_mixed_precision_does_not_overflow():
    layer = Layer(axis=-1, input_shape=(1, 1, 1), fused=True, dtype="mixed_float16")
    y = layer(np.array([-1000.0, 1000.0]).reshape((2, 1, 1, 1)), training=True)
    np.testing.assert_allclose(tf.cast(y, tf.float32).numpy().ravel(), [-1.0, 1.0], atol=1e-3)


def test_integer_inputs_are_normalized_as_floats():
    """Keras casts integer inputs to the compute dtype; they are not truncated back to integers."""
    x = tf.constant([[-1], [0], [0], [1]])
    ours, keras = Layer()(x, training=True), tf.keras.layers.BatchNormalization()(x, training=True)
    assert ours.dtype == keras.dtype == tf.float32
    np.testing.assert_allclose(ours.numpy(), keras.numpy(), rtol=1e-6)


def test_can_be_used_in_multiple_graphs():
    layer = Layer(scale=False, center=False, fused=True)
    fn1 = tf.function(lambda x: layer(x, training=True))
    fn2 = tf.function(lambda x: layer(x, training=True))
    x = np.array([-1000.0, 1000.0], np.float32).reshape((2, 1, 1, 1))
    y = layer(fn2(fn1(x)), training=True)
    np.testing.assert_allclose(y.numpy().ravel(), [-0.9995, 0.9995], atol=1e-4)


def test_fused_is_accepted_and_changes_nothing():
    """Keras' fused kernel is an implementation choice: any value gives the same results here (and
    fused=True with synchronized statistics is not an error, unlike Keras' synchronized layer)."""
    x = np.random.default_rng(7).normal(size=(8, 3, 3, 2)).astype(np.float32)
    outputs = [Layer(fused=fused)(x, training=True).numpy() for fused in (None, True, False)]
    np.testing.assert_array_equal(outputs[0], outputs[1])
    np.testing.assert_array_equal(outputs[0], outputs[2])
    with pytest.raises(ValueError, match="fused must be None, True or False"):
        Layer(fused="yes")


@pytest.mark.parametrize("kwargs, message", [
    (dict(renorm=True), "does not implement renorm"), (dict(adjustment=lambda shape: (1.0, 0.0)), "does not implement adjustment"),
    (dict(virtual_batch_size=2), r"takes no virtual_batch_size \(got 2\): virtual batches are groups of a rank's own "
                                 r"examples, which need no synchronization. Keep Keras' BatchNormalization")])
def test_unimplemented_arguments_are_a_clear_value_error(kwargs, message):
    """Deliberate: batch renormalization and adjustment are not implemented; virtual batches are
    Keras' layer's (convert_sync_batchnorm leaves it)."""
    with pytest.raises(ValueError, match=message):
        Layer(**kwargs)
    Layer(renorm=False, renorm_clipping=None, renorm_momentum=0.99, virtual_batch_size=None, adjustment=None)


@pytest.mark.parametrize("shape", [[2, 1, 1, 1], [2, 1, 1, 1, 1]])
def test_bessels_correction(shape):
    """Deliberate: the moving variance tracks the biased variance by default (Keras' unfused layer);
    unbiased_moving_variance=True gives Keras' fused kernel's, which convert_sync_batchnorm sets
    where Keras' layer used that kernel."""
    x = tf.reshape(tf.constant([0.0, 2.0]), shape)
    for unbiased, expected in ((False, 0.5), (True, 1.0)):
        layer = Layer(momentum=0.5, moving_variance_initializer="zeros", unbiased_moving_variance=unbiased)
        layer(x, training=True)
        assert layer.moving_variance.numpy() == pytest.approx([expected])


def test_empty_batch_keeps_moving_statistics_and_gives_zero_gradients():
    """Keras' test_fused_batchnorm_empty_batch, without a tf.distribute strategy."""
    layer = Layer()
    x = tf.ones((0, 2, 2, 2))
    with tf.GradientTape() as tape:
        y = layer(x, training=True)
    assert y.shape == (0, 2, 2, 2)
    assert [v.name for v in tape.watched_variables()[:2]] == [layer.gamma.name, layer.beta.name]
    np.testing.assert_array_equal(layer.moving_mean.numpy(), 0.0)
    np.testing.assert_array_equal(layer.moving_variance.numpy(), 1.0)


def test_masked_positions_are_left_out_of_the_statistics_as_keras_does():
    """Keras 2's masked batch norm (tf.nn.weighted_moments over the kept positions): Masking ->
    batch norm -> GlobalAveragePooling1D (which reads the mask the layer hands on), the same
    outputs, gradients and moving statistics."""
    x = np.random.default_rng(3).normal(loc=2.0, scale=3.0, size=(4, 6, 3)).astype("float32")
    x[0, 4:], x[1, 1:3], x[3, 5:] = 0.0, 0.0, 0.0  # masked by Masking(0.0)
    w = np.random.default_rng(4).normal(size=(4, 3)).astype("float32")
    results = []
    for bn in (Layer(momentum=0.5), tf.keras.layers.BatchNormalization(momentum=0.5)):
        inputs = tf.keras.Input((6, 3))
        model = tf.keras.Model(inputs, tf.keras.layers.GlobalAveragePooling1D()(bn(tf.keras.layers.Masking(0.0)(inputs))))
        bn.gamma.assign([1.5, -0.5, 2.0])
        bn.beta.assign([0.1, 0.2, -0.3])
        with tf.GradientTape() as tape:
            y = model(x, training=True)
            loss = tf.reduce_sum(y * w)
        results.append([t.numpy() for t in (y, *tape.gradient(loss, [bn.gamma, bn.beta]), bn.moving_mean,
                                            bn.moving_variance)])
    for ours, theirs, name in zip(*results, ["y", "dgamma", "dbeta", "moving_mean", "moving_variance"]):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("kwargs, shape", [(dict(), (2, 3, 3, 4)), (dict(synchronized=False), (2, 3, 3, 4)),
                                           (dict(synchronized=False), (2, 4)),
                                           (dict(synchronized=False, fused=False), (2, 3, 3, 4)),
                                           (dict(synchronized=False, axis=1), (2, 4, 3, 3))])
def test_fused_reads_as_keras_does(kwargs, shape):
    """Keras 2 code reads ``layer.fused``: False for a synchronized layer (as Keras' own with
    synchronized=True), else whether its fused kernel runs (4-D, channels on axis 1 or 3)."""
    ours, theirs = Layer(**kwargs), tf.keras.layers.BatchNormalization(**{"synchronized": True, **kwargs})
    assert ours.fused == theirs.fused
    ours.build(shape)
    theirs.build(shape)
    assert ours.fused is theirs.fused, (kwargs, shape)
