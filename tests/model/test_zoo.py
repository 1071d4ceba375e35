"""The built-in models: their batch norm and ReLU layers; seeded dropout, masks keyed by (seed, rank, call count)."""
import functools

import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.keras2 import SyncBatchNormalization
from hvdtrain.model.sync_bn import SyncBatchNormalizationBase
from hvdtrain.config import ModelConfig
from hvdtrain.errors import HvdtrainError
from hvdtrain.model.zoo import (SeededDropout, build_model, norm_factory, resnet20, set_dropout_rank, seed_cnn,
                             unfused_norm)


def _count(model, layer_type, **attrs):
    return sum(isinstance(m, layer_type) and all(getattr(m, k) == v for k, v in attrs.items()) for m in model.layers)


# (builder, batch norms followed by a ReLU, batch norms followed by something else)
MODELS = [(seed_cnn, 3, 0), (resnet20, 10, 11)]


@pytest.mark.parametrize("build, with_relu, without_relu", MODELS, ids=["cnn", "resnet20"])
@pytest.mark.parametrize("sync_bn", [True, False], ids=["synchronized", "per-rank"])
def test_batch_norm_applies_the_relu_after_it_itself(build, with_relu, without_relu, sync_bn):
    """Synchronized and per-rank (``--no-sync-bn``) models have the same layers: hvdtrain's."""
    fused = build((28, 28, 1), 10, norm=norm_factory(sync_bn))
    assert _count(fused, SyncBatchNormalization, activation="relu", synchronized=sync_bn) == with_relu
    assert _count(fused, SyncBatchNormalization, activation=None, synchronized=sync_bn) == without_relu
    assert _count(fused, tf.keras.layers.BatchNormalization) == 0
    assert _count(fused, tf.keras.layers.ReLU) == (9 if build is resnet20 else 0)  # after each residual add


def _resnet20_before_fusion(input_shape, num_classes, make_norm_layer):
    """ResNet-20 as hvdtrain built it before the ReLU was fused into the batch norm layers (up to
    commit 0f0a461): the same layers, created in the same order, with ReLU layers of their own.
    Its checkpoints must resume in the fused model."""
    def conv(filters, kernel, strides=1):
        return tf.keras.layers.Conv2D(filters, kernel, strides, padding="same", use_bias=False,
                                      kernel_initializer="he_normal")

    inputs = tf.keras.Input(input_shape)
    x = tf.keras.layers.ReLU()(make_norm_layer()(conv(16, 3)(inputs)))
    for stage, filters in enumerate((16, 32, 64)):
        for block in range(3):
            strides = 2 if stage > 0 and block == 0 else 1
            shortcut = x
            y = tf.keras.layers.ReLU()(make_norm_layer()(conv(filters, 3, strides)(x)))
            y = make_norm_layer()(conv(filters, 3)(y))
            if strides != 1 or shortcut.shape[-1] != filters:
                shortcut = make_norm_layer()(conv(filters, 1, strides)(shortcut))
            x = tf.keras.layers.ReLU()(tf.keras.layers.Add()([shortcut, y]))
    x = tf.keras.layers.GlobalAveragePooling2D()(x)
    return tf.keras.Model(inputs, tf.keras.layers.Dense(num_classes)(x))


BEFORE_FUSION = {
    "cnn": (seed_cnn, lambda shape, classes, make_norm_layer: seed_cnn(shape, classes, norm=unfused_norm(make_norm_layer),
                                                                       dropout=0.0)),
    "resnet20": (resnet20, _resnet20_before_fusion),
}


# Batch norm layers of the models before fusion: synchronized, and per-rank (--no-sync-bn built
# Keras' layer up to 2026-12-02).
BEFORE_FUSION_NORMS = {
    "synchronized": (functools.partial(SyncBatchNormalization, momentum=0.9), True),
    "per-rank": (functools.partial(tf.keras.layers.BatchNormalization, momentum=0.9), False),
}


@pytest.mark.parametrize("norm", list(BEFORE_FUSION_NORMS))
@pytest.mark.parametrize("name", list(BEFORE_FUSION))
def test_a_checkpoint_of_the_model_before_fusion_restores_into_the_fused_one(name, norm, tmp_path):
    """Checkpoints written before the ReLU was fused (and, with per-rank batch norm, before it was
    hvdtrain's layer) resume into the same function: after the restore, both models give the same
    outputs."""
    build, build_before = BEFORE_FUSION[name]
    make_norm_layer, sync_bn = BEFORE_FUSION_NORMS[norm]
    before = build_before((28, 28, 1), 10, make_norm_layer)
    rng = np.random.default_rng(0)
    for v in before.variables:
        values = rng.normal(size=v.shape)
        v.assign((np.abs(values) + 0.5 if "moving_variance" in v.name else values).astype(v.dtype.as_numpy_dtype))
    path = tf.train.Checkpoint(model=before).write(str(tmp_path / "state"))
    fused_norm = norm_factory(sync_bn)
    fused = (build((28, 28, 1), 10, norm=fused_norm, dropout=0.0) if build is seed_cnn
             else build((28, 28, 1), 10, norm=fused_norm))
    tf.train.Checkpoint(model=fused).read(path).assert_existing_objects_matched()
    images = rng.uniform(size=(4, 28, 28, 1)).astype(np.float32)
    np.testing.assert_allclose(fused(images, training=False).numpy(), before(images, training=False).numpy(),
                               rtol=1e-5, atol=1e-5)


def _dropout_model(rank: int):
    layer = SeededDropout(0.5, seed=3, rank=rank)
    return tf.keras.Sequential([tf.keras.Input((64,)), layer]), layer


def _nth_call(rank: int, n: int, x):
    """The output of call ``n`` of a fresh dropout model of ``rank``: that rank's n-th mask."""
    model, _ = _dropout_model(rank)
    for _ in range(n - 1):
        model(x, training=True)
    return model(x, training=True).numpy()


def test_set_dropout_rank_rekeys_the_masks_at_the_next_trace():
    """After an elastic reset renumbers the ranks, a worker draws the masks of its new rank."""
    x = tf.ones([8, 64])
    model, layer = _dropout_model(rank=0)
    as_rank_0 = model(x, training=True).numpy()  # call 1, rank 0's stream
    set_dropout_rank(model, 1)
    step = tf.function(lambda t: model(t, training=True))  # a new trace, as after every reset
    after = step(x).numpy()  # call 2, now rank 1's stream
    assert layer.rank == 1 and layer.get_config()["rank"] == 1
    np.testing.assert_array_equal(after, _nth_call(rank=1, n=2, x=x))
    assert not np.array_equal(after, _nth_call(rank=0, n=2, x=x))
    assert not np.array_equal(as_rank_0, after)


def test_a_step_traced_before_keeps_the_old_rank():
    """Why hvdtrain traces a new step after every reset: the rank is fixed into the trace."""
    x = tf.ones([8, 64])
    model, _ = _dropout_model(rank=0)
    old_step = tf.function(lambda t: model(t, training=True))
    old_step(x)  # traced with rank 0
    set_dropout_rank(model, 1)
    np.testing.assert_array_equal(old_step(x).numpy(), _nth_call(rank=0, n=2, x=x))


def test_set_dropout_rank_reaches_nested_models_and_only_seeded_dropout():
    inner, _ = _dropout_model(rank=0)
    inputs = tf.keras.Input((64,))
    outer = tf.keras.Model(inputs, tf.keras.layers.Dense(3)(inner(inputs)))
    set_dropout_rank(outer, 4)
    assert [m.rank for m in outer.submodules if isinstance(m, SeededDropout)] == [4]
    cnn = seed_cnn((28, 28, 1), 10, rank=0)
    config_before = {m.name: m.get_config() for m in cnn.layers if not isinstance(m, SeededDropout)}
    set_dropout_rank(cnn, 5)
    dropouts = [m for m in cnn.submodules if isinstance(m, SeededDropout)]
    assert dropouts and all(d.rank == 5 for d in dropouts)
    assert {m.name: m.get_config() for m in cnn.layers if not isinstance(m, SeededDropout)} == config_before


@pytest.mark.parametrize("function, message", [
    ("wrong_outputs", r"the model outputs shape \(2, 11\) for 2 images, expected \(2, 10\) logits"),
    ("subclassed_wrong_outputs", r"the model outputs shape \(2, 12\) for 2 images, expected \(2, 10\) logits"),
    ("per_pixel_outputs", r"the model outputs shape \(2, 26, 26, 10\) for 2 images, expected \(2, 10\) logits"),
    ("returns_a_dict", r"the model returns dict, expected one \(2, 10\) tensor of logits for 2 images"),
    ("fails_when_called", r"the model fails on a batch of \(2, 28, 28, 1\) images: (ValueError|InvalidArgumentError)"),
])
def test_a_model_function_with_the_wrong_outputs_is_refused(function, message):
    """Checked by calling the model on two images: Keras knows no output shape for a subclassed model."""
    with pytest.raises(HvdtrainError, match=rf"--model 'tests.helpers.models:{function}': {message}"):
        build_model(f"tests.helpers.models:{function}", (28, 28, 1), 10)


def test_the_output_shape_asked_for_is_checked_for_built_in_models_too():
    with pytest.raises(HvdtrainError, match=r"--model 'cnn': the model outputs shape \(2, 10\) for 2 images, expected "
                                            r"\(2, 28, 28, 10\) per-pixel logits"):
        build_model("cnn", (28, 28, 1), 10, output_shape=(28, 28, 10), outputs="per-pixel logits")


def test_unet_gives_per_pixel_logits_and_refuses_sizes_it_cannot_pool():
    model = build_model("unet", (28, 28, 1), 11, output_shape=(28, 28, 11))
    assert model(tf.zeros((3, 28, 28, 1))).shape == (3, 28, 28, 11)
    assert sum(isinstance(m, SyncBatchNormalizationBase) and m.synchronized for m in model.layers) == 10
    with pytest.raises(HvdtrainError, match="--model unet pools 2 times: the images' height and width must be "
                                            "multiples of 4, got 30x28"):
        build_model("unet", (30, 28, 1), 11)


def test_a_subclassed_model_function_builds():
    model = build_model("tests.helpers.models:subclassed", (28, 28, 1), 10)
    assert model(tf.zeros((3, 28, 28, 1))).shape == (3, 10)


def test_no_sync_bn_is_refused_with_a_model_function():
    with pytest.raises(HvdtrainError, match=r"--no-sync-bn applies to the built-in models only; the function of "
                                            r"--model 'mypkg.models:build' chooses its own layers"):
        ModelConfig(name="mypkg.models:build", sync_bn=False)
    assert not ModelConfig(name="resnet20", sync_bn=False).sync_bn


@pytest.mark.parametrize("function, rank, warned", [
    ("mlp_with_keras_dropout", 0, True), ("mlp_with_keras_dropout", 1, False), ("mlp", 0, False)])
def test_keras_random_layers_in_a_model_function_are_named_once(function, rank, warned, capsys):
    """Keras' Dropout keeps its random state outside the model's variables, so a resumed run would
    draw other masks: rank 0 says so (also for a layer nested in a sub-model); the others stay quiet."""
    build_model(f"tests.helpers.models:{function}", (8, 8, 1), 10, rank=rank)
    err = capsys.readouterr().err
    assert ("hvdtrain: warning: --model 'tests.helpers.models:mlp_with_keras_dropout' has Keras random layers (Dropout)"
            in err) is warned, err
