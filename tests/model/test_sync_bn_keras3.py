"""hvdtrain.keras3.SyncBatchNormalization as a drop-in for Keras 3's BatchNormalization: what Keras
3's own ``keras/src/layers/normalization/batch_normalization_test.py`` checks, run against
hvdtrain's layer (one process: world size 1, no collective), plus the same outputs and moving
statistics as Keras 3's layer, its ``.keras`` round trip, mixed precision, and converting Keras 3
models. Deliberate differences (renorm refused) are marked "deliberate"."""
import numpy as np
import pytest

from tests.helpers.kerases import KERAS_3

pytestmark = pytest.mark.skipif(not KERAS_3, reason="needs Keras 3 (TensorFlow >= 2.16)")


@pytest.fixture(scope="module")
def keras():
    import keras

    return keras


@pytest.fixture(scope="module")
def Layer():  # noqa: N802 -- the class under test
    from hvdtrain.keras3 import SyncBatchNormalization

    return SyncBatchNormalization


@pytest.mark.parametrize("kwargs, input_shape, trainable, losses", [
    (dict(center=True, scale=True), (2, 3), 2, 0),
    (dict(center=False, scale=False), (2, 3), 0, 0),
    (dict(center=True, scale=True, beta_regularizer="l2", gamma_regularizer="l2"), (2, 4, 4, 3), 2, 2),
])
def test_bn_basics(keras, Layer, kwargs, input_shape, trainable, losses):
    """Keras 3's run_layer_test: output shape, weight counts, regularizer losses, a config round
    trip with the same outputs, and training in a compiled Keras 3 model."""
    layer = Layer(**kwargs)
    x = np.random.default_rng(0).normal(size=input_shape).astype("float32")
    y = np.asarray(layer(x, training=True))
    assert y.shape == input_shape and y.dtype == np.float32
    assert (len(layer.trainable_weights), len(layer.non_trainable_weights)) == (trainable, 2)
    assert len(layer.losses) == losses
    clone = Layer.from_config(layer.get_config())
    clone.build(input_shape)
    clone.set_weights(layer.get_weights())
    np.testing.assert_allclose(np.asarray(clone(x, training=False)), np.asarray(layer(x, training=False)), atol=1e-6)
    model = keras.Sequential([keras.Input(input_shape[1:]), Layer(**kwargs)])
    model.compile("rmsprop", "mse")
    model.fit(x, x, batch_size=2, epochs=1, verbose=0)


@pytest.mark.parametrize("axis", [-1, 1])
@pytest.mark.parametrize("input_shape", [(5, 2, 3), (5, 3, 3, 2)])
@pytest.mark.parametrize("moving_mean_initializer", ["zeros", "ones"])
@pytest.mark.parametrize("moving_variance_initializer", ["zeros", "ones"])
def test_correctness(keras, Layer, axis, input_shape, moving_mean_initializer, moving_variance_initializer):
    """Keras 3's test_correctness: normalized outputs, momentum-0 moving statistics, inference
    against training; the masked half is test_masked_positions_are_left_out_of_the_statistics_as_keras_does."""
    layer = Layer(axis=axis, momentum=0, moving_mean_initializer=moving_mean_initializer,
                  moving_variance_initializer=moving_variance_initializer)
    x = np.random.default_rng(1).normal(loc=5.0, scale=10.0, size=input_shape).astype("float32")
    out = x
    for _ in range(3):
        out = layer(out, training=True)
    broadcast = [1] * len(input_shape)
    broadcast[axis] = input_shape[axis]
    out = (np.asarray(out) - np.reshape(np.asarray(layer.beta), broadcast)) / np.reshape(np.asarray(layer.gamma),
                                                                                          broadcast)
    reduction = tuple(a for a in range(len(input_shape)) if a != axis % len(input_shape))
    np.testing.assert_allclose(out.mean(axis=reduction), 0.0, atol=1e-3)
    np.testing.assert_allclose(out.std(axis=reduction), 1.0, atol=1e-3)
    np.testing.assert_allclose(np.asarray(layer.moving_mean), 0.0, atol=1e-3)
    np.testing.assert_allclose(np.asarray(layer.moving_variance), 1.0, atol=1e-3)
    inference, training = layer(x, training=False), layer(x, training=True)
    assert not np.allclose(np.asarray(inference), np.asarray(training), atol=1e-3)
    training, inference = layer(x, training=True), layer(x, training=False)
    np.testing.assert_allclose(np.asarray(inference), np.asarray(training), atol=1e-4)


@pytest.mark.parametrize("kwargs, input_shape", [
    (dict(), (6, 4)), (dict(axis=1), (6, 3, 4, 4)), (dict(momentum=0.5, epsilon=1e-5), (6, 4, 4, 3)),
    (dict(center=False, gamma_initializer="random_normal"), (6, 5, 2)),
])
def test_same_outputs_and_moving_statistics_as_keras_3s_layer(keras, Layer, kwargs, input_shape):
    """Three training calls and one inference call: the outputs, the gradient with respect to the
    input and the moving statistics are Keras 3's own layer's (both track the biased variance)."""
    import tensorflow as tf

    theirs, ours = keras.layers.BatchNormalization(**kwargs), Layer(**kwargs)
    theirs.build(input_shape)
    ours.build(input_shape)
    ours.set_weights(theirs.get_weights())
    x = tf.constant(np.random.default_rng(2).normal(loc=3.0, scale=2.0, size=input_shape).astype("float32"))
    for _ in range(3):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            a, b = theirs(x, training=True), ours(x, training=True)
            weights = tf.constant(np.random.default_rng(3).normal(size=input_shape).astype("float32"))
            la, lb = tf.reduce_sum(a * weights), tf.reduce_sum(b * weights)
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(tape.gradient(lb, x)), np.asarray(tape.gradient(la, x)), rtol=1e-3,
                                   atol=1e-4)
    for mine, keras_own in zip(ours.non_trainable_weights, theirs.non_trainable_weights):
        np.testing.assert_allclose(np.asarray(mine), np.asarray(keras_own), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ours(x, training=False)), np.asarray(theirs(x, training=False)),
                               rtol=1e-4, atol=1e-4)


def test_trainable_behavior(Layer):
    """Keras 3's test_trainable_behavior: frozen, the layer uses its moving statistics even in
    training and has no trainable weights; unfrozen, it normalizes."""
    layer = Layer(axis=-1, momentum=0.8, epsilon=1e-7)
    layer.build((1, 4, 4, 3))
    layer.trainable = False
    assert (len(layer.weights), len(layer.trainable_weights), len(layer.non_trainable_weights)) == (4, 0, 4)
    x = np.random.default_rng(4).normal(loc=5.0, scale=10.0, size=(200, 4, 4, 3)).astype("float32")
    np.testing.assert_allclose(np.asarray(layer(x, training=True)), x, rtol=1e-5, atol=1e-5)
    layer.trainable = True
    assert (len(layer.weights), len(layer.trainable_weights), len(layer.non_trainable_weights)) == (4, 2, 2)
    for _ in range(10):
        out = layer(x, training=True)
    out = (np.asarray(out) - np.asarray(layer.beta)) / np.asarray(layer.gamma)
    np.testing.assert_allclose(out.mean(axis=(0, 1, 2)), 0.0, atol=1e-3)
    np.testing.assert_allclose(out.std(axis=(0, 1, 2)), 1.0, atol=1e-3)


def test_large_value_within_autocast_scope(keras, Layer):
    """Keras 3's test: the moving variance is float32 and not autocast to float16 (70000 would overflow)."""
    layer = Layer()
    layer.build((1, 4, 4, 3))
    with keras.src.backend.AutocastScope("float16"):
        layer.moving_variance.assign(np.full((3,), 70000.0, "float32"))
        np.testing.assert_allclose(np.asarray(layer.moving_variance.value), 70000.0)


@pytest.mark.parametrize("policy, dtype", [("mixed_float16", "float16"), ("mixed_bfloat16", "bfloat16")])
def test_mixed_precision(keras, Layer, policy, dtype):
    """Under a mixed policy the output is in the compute dtype; weights and statistics stay float32."""
    layer = Layer(dtype=policy)
    out = layer(np.random.default_rng(5).normal(size=(4, 3)).astype("float32"), training=True)
    assert keras.backend.standardize_dtype(out.dtype) == dtype
    assert {v.dtype for v in layer.weights} == {"float32"}


def test_serialization_and_keras_file_round_trip(keras, Layer, tmp_path):
    """get_config -> from_config -> get_config is the identity; a model holding the layer saves to
    a .keras file and loads back (hvdtrain's layer registered with Keras 3) with the same outputs."""
    layer = Layer(axis=1, momentum=0.7, epsilon=1e-4, activation="relu", unbiased_moving_variance=True,
                  synchronized=False, beta_regularizer="l1")
    assert Layer.from_config(layer.get_config()).get_config() == layer.get_config()
    model = keras.Sequential([keras.Input((3, 4)), Layer(activation="relu"), keras.layers.Flatten(),
                              keras.layers.Dense(2)])
    x = np.random.default_rng(6).normal(size=(5, 3, 4)).astype("float32")
    model(x, training=True)
    model.save(tmp_path / "m.keras")
    import hvdtrain

    loaded = hvdtrain.load_model(str(tmp_path / "m.keras"))
    assert type(loaded.layers[0]) is Layer
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(model(x)))


def test_masked_positions_are_left_out_of_the_statistics_as_keras_does(keras, Layer):
    """Keras 3's masked test_correctness, against Keras 3's layer: Masking -> batch norm ->
    GlobalAveragePooling1D (which reads the mask the layer hands on), the same outputs, gradients
    and moving statistics (Keras adds 1e-7 to its count: 1e-8 of it here)."""
    import tensorflow as tf

    x = np.random.default_rng(3).normal(loc=2.0, scale=3.0, size=(4, 6, 3)).astype("float32")
    x[0, 4:], x[1, 1:3], x[3, 5:] = 0.0, 0.0, 0.0  # masked by Masking(0.0)
    w = np.random.default_rng(4).normal(size=(4, 3)).astype("float32")
    results = []
    for bn in (Layer(momentum=0.5), keras.layers.BatchNormalization(momentum=0.5)):
        inputs = keras.Input((6, 3))
        model = keras.Model(inputs, keras.layers.GlobalAveragePooling1D()(bn(keras.layers.Masking(0.0)(inputs))))
        bn.gamma.assign([1.5, -0.5, 2.0])
        bn.beta.assign([0.1, 0.2, -0.3])
        with tf.GradientTape() as tape:
            y = model(x, training=True)
            loss = tf.reduce_sum(y * w)
        results.append([np.asarray(t) for t in (y, *tape.gradient(loss, [bn.gamma, bn.beta]), bn.moving_mean,
                                                bn.moving_variance)])
    for ours, theirs, name in zip(*results, ["y", "dgamma", "dbeta", "moving_mean", "moving_variance"]):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6, err_msg=name)
    unmasked = Layer(momentum=0.5)
    unmasked(x, training=True)
    assert not np.allclose(np.asarray(unmasked.moving_mean), results[0][3], atol=1e-2), "the mask changed nothing"


def test_virtual_batches_name_keras_layer_as_the_alternative(Layer):
    with pytest.raises(ValueError, match=r"takes no virtual_batch_size \(got 4\): virtual batches are groups of a "
                                         r"rank's own examples, which need no synchronization. Keep Keras' "
                                         r"BatchNormalization\(virtual_batch_size=...\)"):
        Layer(virtual_batch_size=4)


def test_renorm_is_refused(Layer):
    """Deliberate: batch renormalization (Keras 3.15's renorm) is not implemented."""
    with pytest.raises(ValueError, match="does not implement renorm"):
        Layer(renorm=True)


def test_converting_keras_3_models(keras):
    """convert_sync_batchnorm on Keras 3: BatchNormalization(synchronized=True) and MobileNetV2's 52
    layers become hvdtrain's Keras 3 layer, with the same inference outputs."""
    import hvdtrain
    from hvdtrain.model.convert import keras_batch_norm_layers
    from tests.helpers.models import keras3_mobilenet_v2

    model = keras3_mobilenet_v2((32, 32, 3), 10)
    converted = hvdtrain.convert_sync_batchnorm(model)
    assert len(keras_batch_norm_layers(model)) == 52 and not keras_batch_norm_layers(converted)
    assert sum(type(layer) is hvdtrain.keras3.SyncBatchNormalization for layer in converted.layers) == 52
    x = np.random.default_rng(7).normal(size=(2, 32, 32, 3)).astype("float32")
    np.testing.assert_allclose(np.asarray(converted(x)), np.asarray(model(x)), atol=1e-5)
    synchronized = keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization(synchronized=True)])
    (layer,) = hvdtrain.convert_sync_batchnorm(synchronized).layers
    assert type(layer) is hvdtrain.keras3.SyncBatchNormalization and layer.synchronized


def test_a_converted_subclassed_keras_3_model_checkpoints_every_variable(keras, tmp_path):
    """A subclassed Keras 3 model, built, with batch norm layers in an attribute, a list and a dict,
    converted in place: the new layers are the ones called and trained, and a checkpoint restores
    every variable of the model, their moving statistics included, into a fresh copy."""
    import tensorflow as tf

    import hvdtrain
    from hvdtrain.checkpoint import CheckpointManager

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.bn = keras.layers.BatchNormalization()
            self.norms = [keras.layers.BatchNormalization()]
            self.named = {"last": keras.layers.BatchNormalization()}
            self.dense = keras.layers.Dense(2)

        def call(self, x, training=False):
            x = self.named["last"](self.norms[0](self.bn(x, training=training), training=training), training=training)
            return self.dense(x)

    def converted():
        net = Net()
        net(tf.zeros((2, 3)))
        assert hvdtrain.convert_sync_batchnorm(net) is net
        return net

    net = converted()
    layers = net._flatten_layers(include_self=False)
    assert [type(layer).__name__ for layer in layers].count("SyncBatchNormalization") == 3
    x = np.random.default_rng(8).normal(loc=2.0, size=(16, 3)).astype("float32")
    net(x, training=True)  # the converted layers run: their moving statistics move
    assert not np.allclose(np.asarray(net.bn.moving_mean), 0.0)
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(net.trainable_variables)
    manager = CheckpointManager(str(tmp_path), net, optimizer)
    manager.save(1, {})
    fresh = converted()
    fresh_optimizer = keras.optimizers.SGD(0.1)
    fresh_optimizer.build(fresh.trainable_variables)
    CheckpointManager(str(tmp_path), fresh, fresh_optimizer).restore(manager.latest())
    assert len(fresh.variables) == len(net.variables) == 14
    for mine, restored in zip(net.variables, fresh.variables):
        np.testing.assert_array_equal(np.asarray(restored), np.asarray(mine), err_msg=mine.path)
