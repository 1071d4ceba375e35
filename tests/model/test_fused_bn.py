"""fuse_keras3_batch_norm: Keras 3's BatchNormalization trained through FusedBatchNormV3 gives
Keras' own output, gradients and moving statistics (float32 rounding), and leaves every case the
kernel does not cover to Keras' call."""
import numpy as np
import pytest
import tensorflow as tf

from hvdtrain import kerases
from hvdtrain.model.fused_bn import fuse_keras3_batch_norm

keras = kerases.keras3() if kerases.keras3_installed() else None
RNG = np.random.default_rng(0)
keras3_only = pytest.mark.skipif(keras is None, reason="Keras 3 is not installed (TensorFlow 2.15)")


def _pair(shape, **config):
    """Two built layers with the same config and weights: Keras' own, and one given the fused call."""
    layers = []
    for _ in range(2):
        layer = keras.layers.BatchNormalization(**config)
        layer.build(shape)
        layers.append(layer)
    for weights in (w for w in (layers[0].gamma, layers[0].beta) if w is not None):
        weights.assign(RNG.normal(size=weights.shape).astype(np.float32) + 1.0)
    layers[1].set_weights(layers[0].get_weights())
    return layers


def _train(layer, x):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=True)
        loss = tf.reduce_sum(y * tf.cos(y))
    grads = tape.gradient(loss, [x, *layer.trainable_variables])
    return y, grads


@keras3_only
@pytest.mark.parametrize("shape, config", [((6, 5, 5, 3), {}), ((16, 8), {"momentum": 0.9, "epsilon": 1e-4}),
                                           ((4, 7, 3), {"center": False}), ((5, 2, 3, 4), {"scale": False})],
                         ids=["nhwc", "dense", "sequence", "no-scale"])
def test_the_fused_call_is_keras_own_to_rounding(shape, config):
    ours, theirs = _pair(shape, **config)
    assert fuse_keras3_batch_norm(ours) == 1
    x = tf.constant(RNG.normal(size=shape).astype(np.float32) * 3.0 + 2.0)

    @tf.function
    def both(x):
        return _train(ours, x), _train(theirs, x)

    for _ in range(3):  # the moving statistics move three times
        (y, grads), (y_keras, grads_keras) = both(x)
        np.testing.assert_allclose(y, y_keras, rtol=1e-5, atol=1e-5)
        for g, g_keras in zip(grads, grads_keras):
            np.testing.assert_allclose(g, g_keras, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(ours.moving_mean, theirs.moving_mean, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ours.moving_variance, theirs.moving_variance, rtol=1e-5, atol=1e-6)
    assert any("FusedBatchNormV3" == op.type for op in both.get_concrete_function(x).graph.get_operations())
    np.testing.assert_allclose(ours(x, training=False), theirs(x, training=False), rtol=1e-5, atol=1e-5)


@keras3_only
def test_a_batch_of_one_has_a_variance_of_zero():
    ours, theirs = _pair((1, 4))
    fuse_keras3_batch_norm(ours)
    x = tf.constant(RNG.normal(size=(1, 4)).astype(np.float32))
    ours(x, training=True), theirs(x, training=True)
    np.testing.assert_allclose(ours.moving_variance, theirs.moving_variance, rtol=1e-6)


@keras3_only
@pytest.mark.parametrize("case", ["float64", "mask", "axis-1", "small-epsilon", "frozen"])
def test_what_the_kernel_does_not_cover_is_keras_own_call(case):
    config = {"axis-1": {"axis": 1}, "small-epsilon": {"epsilon": 1e-6}}.get(case, {})
    if case == "float64":
        config["dtype"] = "float64"
    shape = (6, 5, 3)
    ours, theirs = _pair(shape, **config)
    fuse_keras3_batch_norm(ours)
    if case == "frozen":
        ours.trainable = theirs.trainable = False
    x = tf.constant(RNG.normal(size=shape), dtype="float64" if case == "float64" else "float32")
    mask = tf.constant(RNG.random((6, 5)) > 0.3) if case == "mask" else None

    @tf.function
    def both(x):
        return ours(x, training=True, mask=mask), theirs(x, training=True, mask=mask)

    y, y_keras = both(x)
    np.testing.assert_array_equal(y, y_keras)  # the same ops: bit for bit
    assert not any(op.type == "FusedBatchNormV3" for op in both.get_concrete_function(x).graph.get_operations())


@pytest.mark.parametrize("package", ["tf.keras", "keras"])
def test_keras2_layers_are_left_alone(package):
    """Keras 2 calls the fused kernel itself: tf.keras on both stacks, and ``keras`` on TensorFlow
    2.15, whose Keras 2 layer sits at Keras 3's module path (``keras.src.layers...``)."""
    import keras as keras_package

    k = tf.keras if package == "tf.keras" else keras_package
    if package == "keras" and kerases.keras3_installed():
        pytest.skip("keras is Keras 3 here (its layers are fused: the tests above)")
    legacy = k.Sequential([k.Input((4,)), k.layers.BatchNormalization()])
    call = legacy.layers[0].call
    assert fuse_keras3_batch_norm(legacy) == 0
    assert legacy.layers[0].call == call


@keras3_only
def test_nested_layers_once_each_and_subclasses_left_alone():
    class MyNorm(keras.layers.BatchNormalization):
        pass

    shared = keras.layers.BatchNormalization()
    inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), shared])
    model = keras.Sequential([keras.Input((4,)), inner, shared, MyNorm(), keras.layers.BatchNormalization()])
    assert fuse_keras3_batch_norm(model) == 2  # shared (held twice) and the last; MyNorm keeps its call
    assert fuse_keras3_batch_norm(model) == 0  # once
