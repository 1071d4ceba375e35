"""SyncBatchNormalization against a float64 oracle: batch norm over the concatenated global batch.

Real ranks (horovodrun --gloo) at np=2 and np=3 (oversubscribed on 2 cores). Each rank runs the
layer on its slice of the global batch; the oracle runs plain batch norm on the whole batch in one
process, in float64, and differentiates it with TensorFlow's autodiff.
"""
import platform
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.keras2 import SyncBatchNormalization
from hvdtrain.model import sync_bn_kernels
from tests.helpers.ranks import REPO, rank_env, run_ranks
from tests.workers.sync_bn_cases import case_data, case_mask, cases

EPSILON, MOMENTUM = 1e-3, 0.9
TOL = 1e-5  # max |ours - oracle| <= TOL * max |oracle|, per tensor


def tolerance(case: dict, key: str) -> float:
    """TOL; for float16 input, its outputs and input gradients are float16, so one rounding of
    2^-11 relative each (statistics, gamma's and beta's gradients and moving statistics are
    float32 and held to TOL)."""
    return 2.0 ** -10 if case.get("dtype") == "float16" and key in ("y", "dx") else TOL


def oracle(x, w, gamma, beta, axis, activation=None, mask=None):
    """Global-batch batch norm (then ReLU, for ``activation="relu"``) in float64: outputs, gradients,
    updated moving statistics. With a ``mask`` (the input's shape without the channel axis), the
    statistics are those of the positions it keeps (tf.nn.weighted_moments), as Keras' layer."""
    x = tf.constant(x, tf.float64)
    ndim = x.shape.rank
    axis = axis % ndim
    reduce_axes = [a for a in range(ndim) if a != axis]
    bshape = [x.shape[a] if a == axis else 1 for a in range(ndim)]
    g = tf.Variable(np.reshape(gamma, bshape).astype(np.float64))
    b = tf.Variable(np.reshape(beta, bshape).astype(np.float64))
    with tf.GradientTape() as tape:
        tape.watch(x)
        if mask is None:
            mean, var = tf.nn.moments(x, reduce_axes, keepdims=True)
        else:
            weights = tf.expand_dims(tf.constant(mask, tf.float64), axis)
            mean, var = tf.nn.weighted_moments(x, reduce_axes, weights, keepdims=True)
        y = (x - mean) / tf.sqrt(var + EPSILON) * g + b
        if activation == "relu":
            y = tf.nn.relu(y)
        loss = tf.reduce_sum(y * w)
    dx, dg, db = tape.gradient(loss, [x, g, b])
    return {"y": y.numpy(), "dx": dx.numpy(), "dgamma": dg.numpy().ravel(), "dbeta": db.numpy().ravel(),
            "moving_mean": (1 - MOMENTUM) * mean.numpy().ravel(),
            "moving_variance": MOMENTUM + (1 - MOMENTUM) * var.numpy().ravel()}


def gather(results, name, key):
    """Per-rank outputs concatenated along the batch (y, dx), summed (dgamma, dbeta), or rank 0's (moving)."""
    parts = [r[f"{name}/{key}"] for r in results]
    if key in ("y", "dx", "hvd_y"):
        return np.concatenate(parts)
    if key in ("dgamma", "dbeta"):
        return np.sum(parts, axis=0).ravel()
    for p in parts[1:]:  # moving statistics: identical on every rank
        np.testing.assert_array_equal(p, parts[0])
    return parts[0].ravel()


def max_rel_error(ours, reference):
    return np.max(np.abs(ours - reference)) / max(np.max(np.abs(reference)), 1e-30)


# (world size, CPU kernels on?): the kernels and the TensorFlow-ops path must both be exact.
@pytest.fixture(scope="module", params=[(2, True), (3, True), (2, False)], ids=["np2", "np3", "np2-tf-ops"])
def rank_results(request, tmp_path_factory):
    world_size, use_kernels = request.param
    if use_kernels and not sync_bn_kernels.available():
        pytest.fail("SyncBatchNormalization CPU kernels are not built (python -m hvdtrain.model.sync_bn_kernels)")
    out = tmp_path_factory.mktemp(f"sync_bn_np{world_size}")
    run_ranks(world_size, ["-m", "tests.workers.sync_bn_cases", str(out)], timeout=240,
              env={"HVDTRAIN_SYNC_BN_KERNELS": "1" if use_kernels else "0"})
    results = [dict(np.load(out / f"rank{r}.npz")) for r in range(world_size)]
    assert [bool(r["kernels"]) for r in results] == [use_kernels] * world_size, "ranks computed on the other path"
    return world_size, results


@pytest.mark.parametrize("name", list(cases(2)))
@pytest.mark.parametrize("key", ["y", "dx", "dgamma", "dbeta", "moving_mean", "moving_variance"])
def test_matches_global_batch_oracle(rank_results, name, key):
    world_size, results = rank_results
    case = cases(world_size)[name]
    x, w, gamma, beta = case_data(name, case)
    expected = oracle(x, w, gamma, beta, case["axis"], case.get("activation"), case_mask(name, case))[key]
    got = gather(results, name, key)
    assert got.shape == expected.shape
    assert np.all(np.isfinite(got)), f"{name}/{key} at np={world_size}"
    assert max_rel_error(got, expected) <= tolerance(case, key), f"{name}/{key} at np={world_size}"


@pytest.mark.parametrize("name", list(cases(2)))
@pytest.mark.parametrize("key", ["y", "dx", "dgamma", "dbeta", "moving_mean", "moving_variance"])
def test_per_rank_layer_matches_each_ranks_own_batch_oracle(rank_results, name, key):
    """With ``synchronized=False`` each rank normalizes (and keeps moving statistics of) its own
    batch alone; a rank with an empty batch leaves its moving statistics at their initial values.
    Off the kernels, half-precision input goes to TensorFlow's fused op, whose float32 statistics
    are its own (not hvdtrain's float64 shifted sums), as in Keras' BatchNormalization: for mean 1e3
    they leave gamma's gradient 2e-4 off, so 1e-3 there for the float32 results."""
    world_size, results = rank_results
    case = cases(world_size)[name]
    fused = case.get("dtype") == "float16" and not bool(results[0]["kernels"])
    x, w, gamma, beta = case_data(name, case)
    mask = case_mask(name, case)
    starts = np.cumsum([0] + case["sizes"])
    for rank, result in enumerate(results):
        got = result[f"per_rank/{name}/{key}"].ravel()
        sl = slice(starts[rank], starts[rank + 1])
        if case["sizes"][rank] == 0 or (mask is not None and not mask[sl].any()):  # nothing counts: as before
            if key in ("moving_mean", "moving_variance"):
                initial = {"moving_mean": 0.0, "moving_variance": 1.0}[key]
                np.testing.assert_array_equal(got, np.full_like(got, initial), err_msg=f"{name}/{key}")
            continue
        expected = oracle(x[sl], w[sl], gamma, beta, case["axis"], case.get("activation"),
                          None if mask is None else mask[sl])[key].ravel()
        tol = max(tolerance(case, key), 1e-3) if fused else tolerance(case, key)
        assert max_rel_error(got, expected) <= tol, f"{name}/{key} of rank {rank} at np={world_size}"


def test_horovod_layer_deviates_on_uneven_batches(rank_results):
    """Horovod's hvd.SyncBatchNormalization averages per-rank moments as if batches were equal."""
    world_size, results = rank_results
    case = cases(world_size)["uneven"]
    x, w, gamma, beta = case_data("uneven", case)
    expected = oracle(x, w, gamma, beta, case["axis"])["y"]
    assert max_rel_error(gather(results, "uneven", "y"), expected) <= TOL
    assert max_rel_error(gather(results, "uneven", "hvd_y"), expected) > 1e-2


# ---- single process: world size 1, inference, dtypes, configuration -------------------------------
# Keras' fused kernel (4-D inputs) tracks the unbiased batch variance, its unfused path the biased one.
# With activation="relu", Keras' layer is followed by a ReLU.
@pytest.mark.parametrize("shape, unbiased, activation", [((8, 5, 5, 4), True, None), ((32, 4), False, None),
                                                         ((8, 5, 5, 4), True, "relu")],
                         ids=["4d_fused", "2d", "4d_relu"])
@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernels", "off-kernels"])
def test_world_size_one_equals_keras_batch_norm(shape, unbiased, activation, use_kernels, monkeypatch):
    """Off the kernels, 4-D inputs take TensorFlow's fused batch norm (as a GPU process does)."""
    if use_kernels and not sync_bn_kernels.available():
        pytest.fail("SyncBatchNormalization CPU kernels are not built (python -m hvdtrain.model.sync_bn_kernels)")
    monkeypatch.setattr(sync_bn_kernels, "available", lambda: use_kernels)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(2.0, 3.0, shape).astype(np.float32))
    ours = SyncBatchNormalization(momentum=0.9, unbiased_moving_variance=unbiased, activation=activation)
    keras = tf.keras.layers.BatchNormalization(momentum=0.9)
    keras_activation = tf.nn.relu if activation == "relu" else tf.identity
    results = []
    for layer, after in ((ours, tf.identity), (keras, keras_activation)):
        layer.build(x.shape)
        layer.gamma.assign(np.arange(1, 5, dtype=np.float32))
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = after(layer(x, training=True))
            loss = tf.reduce_sum(y * tf.sin(x))
        results.append([y, *tape.gradient(loss, [x, layer.gamma, layer.beta]), layer.moving_mean, layer.moving_variance])
    for a, b in zip(*results):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-4)
    # Inference uses the moving statistics, like Keras.
    np.testing.assert_allclose(ours(x, training=False).numpy(), keras_activation(keras(x, training=False)).numpy(),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape, use_kernels", [((16, 6), True), ((4, 3, 3, 6), False)], ids=["2d", "4d_fused_op"])
def test_half_precision_inputs_keep_dtype_and_float32_statistics(dtype, shape, use_kernels, monkeypatch):
    """Also through TensorFlow's fused batch norm, which takes half-precision inputs as they are."""
    monkeypatch.setattr(sync_bn_kernels, "available", lambda: use_kernels and sync_bn_kernels._library() is not None)
    x32 = np.random.default_rng(1).normal(5.0, 2.0, shape).astype(np.float32)
    x = tf.cast(tf.constant(x32), dtype)
    layer, reference = SyncBatchNormalization(), SyncBatchNormalization()
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=True)
        loss = tf.reduce_sum(tf.cast(y, tf.float32) * tf.sin(x32))
    dx = tape.gradient(loss, x)
    assert y.dtype == dtype and dx.dtype == dtype
    assert layer.moving_mean.dtype == tf.float32
    y_reference = reference(tf.cast(x, tf.float32), training=True)
    np.testing.assert_allclose(tf.cast(y, tf.float32).numpy(), y_reference.numpy(), atol=0.05)
    for ours, theirs in ((layer.moving_mean, reference.moving_mean), (layer.moving_variance, reference.moving_variance)):
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-2)


@pytest.mark.parametrize("shape, axis", [((6, 3, 3, 4), -1), ((6, 4, 3, 3), 1)], ids=["channels_last", "channels_first"])
def test_float64_inputs_are_computed_in_float64(shape, axis):
    """A float64 layer matches batch normalization done in NumPy float64 to float64 rounding, forward
    and backward (the float32 path would be 1e-7 off), with data whose mean is far from 0."""
    rng = np.random.default_rng(2)
    x_np = rng.normal(1e3, 1.0, shape)
    w_np = rng.normal(0.0, 1.0, shape)  # loss = sum(y * w), so dL/dy = w
    layer = SyncBatchNormalization(axis=axis, momentum=0.5, epsilon=1e-3, dtype="float64")
    x = tf.constant(x_np)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=True)
        loss = tf.reduce_sum(y * w_np)
    dx, dgamma, dbeta = tape.gradient(loss, [x, layer.gamma, layer.beta])
    assert y.dtype == dx.dtype == layer.moving_mean.dtype == tf.float64

    reduce = tuple(a for a in range(len(shape)) if a != axis % len(shape))
    n = x_np.size / shape[axis]
    mean, var = x_np.mean(reduce, keepdims=True), x_np.var(reduce, keepdims=True)
    x_hat = (x_np - mean) / np.sqrt(var + 1e-3)
    # gamma = 1, beta = 0: dx = (w - mean(w) - x_hat * mean(w * x_hat)) / sigma (Ioffe & Szegedy 2015)
    dx_oracle = (w_np - w_np.sum(reduce, keepdims=True) / n
                 - x_hat * (w_np * x_hat).sum(reduce, keepdims=True) / n) / np.sqrt(var + 1e-3)
    for ours, oracle in [(y, x_hat), (dx, dx_oracle), (dgamma, (w_np * x_hat).sum(reduce)), (dbeta, w_np.sum(reduce)),
                         (layer.moving_mean, 0.5 * mean.ravel()), (layer.moving_variance, 0.5 + 0.5 * var.ravel())]:
        np.testing.assert_allclose(ours.numpy(), oracle, rtol=1e-10, atol=1e-10 * np.abs(oracle).max())


def test_a_mask_of_another_shape_is_a_value_error_naming_both_shapes():
    layer = SyncBatchNormalization()
    with pytest.raises(ValueError, match=r"a mask must have the input's shape without its one channel axis \(Keras' "
                                         r"convention\); got a mask of shape \(2, 3, 4\) for input shape \(2, 3, 4\)"):
        layer(tf.ones((2, 3, 4)), training=True, mask=tf.ones((2, 3, 4), tf.bool))


def test_mixed_precision_policy():
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        layer = SyncBatchNormalization()
        y = layer(tf.ones((4, 3), tf.float16) * tf.constant([1.0, 2.0, 3.0], tf.float16), training=True)
        assert y.dtype == tf.float16 and layer.gamma.dtype == tf.float32
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")


def test_get_config_round_trip():
    layer = SyncBatchNormalization(axis=[1, 3], momentum=0.8, epsilon=1e-4, center=False, scale=True,
                                   gamma_initializer="he_normal", gamma_regularizer="l2",
                                   beta_constraint="non_neg", unbiased_moving_variance=True, activation="relu",
                                   synchronized=False, name="sbn")
    config = layer.get_config()
    assert config["activation"] == "relu" and config["unbiased_moving_variance"] is True
    assert config["synchronized"] is False
    clone = SyncBatchNormalization.from_config(config)
    assert clone.activation == "relu" and not clone.synchronized
    assert clone.get_config() == config
    restored = tf.keras.layers.deserialize(tf.keras.layers.serialize(layer))
    assert isinstance(restored, SyncBatchNormalization) and restored.get_config() == config


def test_unbiased_moving_variance_and_zero_count():
    x = tf.constant([[1.0], [3.0]])
    layer = SyncBatchNormalization(momentum=0.0, unbiased_moving_variance=True)
    layer(x, training=True)
    assert layer.moving_variance.numpy()[0] == pytest.approx(2.0)  # var 1, times n/(n-1) = 2
    layer(tf.zeros((0, 1)), training=True)  # empty global batch: no update, no NaN
    assert layer.moving_mean.numpy()[0] == pytest.approx(2.0)
    assert layer.moving_variance.numpy()[0] == pytest.approx(2.0)


def test_frozen_layer_runs_in_inference_mode_and_passes_gradients():
    layer = SyncBatchNormalization()
    x = tf.constant([[10.0], [20.0]])
    layer(x, training=True)
    mean_before = layer.moving_mean.numpy().copy()
    layer.trainable = False
    with tf.GradientTape() as tape:  # gradients still flow through a frozen layer to the layers before it
        tape.watch(x)
        y = layer(x, training=True)
    np.testing.assert_array_equal(layer.moving_mean.numpy(), mean_before)
    dx = tape.gradient(y, x).numpy()
    expected = layer.gamma.numpy() / np.sqrt(layer.moving_variance.numpy() + layer.epsilon)
    np.testing.assert_allclose(dx, np.broadcast_to(expected, dx.shape), rtol=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    (dict(momentum=1.5), "momentum"), (dict(epsilon=0.0), "epsilon"), (dict(axis="last"), "axis"),
    (dict(axis=[]), "axis"), (dict(activation="tanh"), "activation"),
])
def test_constructor_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SyncBatchNormalization(**kwargs)


@pytest.mark.parametrize("shape, axis, match", [((5,), -1, "rank >= 2"), ((2, 3), 2, "out of range"),
                                                ((2, 3), 0, "batch axis"), ((2, 3, 4), [1, -2], "repeats")])
def test_build_validation(shape, axis, match):
    with pytest.raises(ValueError, match=match):
        SyncBatchNormalization(axis=axis).build(shape)


@pytest.mark.parametrize("activation", [None, "relu"])
@pytest.mark.parametrize("shape", [(64, 5, 5, 8), (300, 3), (0, 4), (0, 3, 3, 4)],
                         ids=["4d", "2d", "empty", "empty_4d"])
def test_cpu_kernels_equal_tensorflow_ops(shape, activation, monkeypatch):
    """The single-pass kernels and the TensorFlow-ops path give the same outputs and gradients
    (at world size 1, TensorFlow's fused batch norm for 4-D inputs)."""
    if not sync_bn_kernels.available():
        pytest.fail("SyncBatchNormalization CPU kernels are not built (python -m hvdtrain.model.sync_bn_kernels)")
    rng = np.random.default_rng(7)
    x = tf.constant(rng.normal(3.0, 2.0, shape).astype(np.float32))
    w = tf.constant(rng.normal(size=shape).astype(np.float32))
    results = []
    for use_kernels in (True, False):
        monkeypatch.setattr(sync_bn_kernels, "available", lambda use=use_kernels: use)
        layer = SyncBatchNormalization(momentum=0.5, activation=activation)
        layer.build(x.shape)
        # A negative gamma and a nonzero beta, so that the ReLU mask depends on both.
        layer.gamma.assign(np.linspace(-0.5, 2.0, shape[-1]).astype(np.float32))
        layer.beta.assign(np.linspace(0.3, -0.2, shape[-1]).astype(np.float32))
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(y * w)
        results.append([y, *tape.gradient(loss, [x, layer.gamma, layer.beta]), layer.moving_variance,
                        layer(x, training=False)])
        with tf.GradientTape() as tape:  # inference mode inside a model being trained (frozen layers)
            tape.watch(x)
            loss = tf.reduce_sum(layer(x, training=False) * w)
        results[-1] += tape.gradient(loss, [x, layer.gamma, layer.beta])
    for a, b in zip(*results):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=2e-5, atol=2e-5)


def _training_ops(layer, x) -> set:
    """The op types of the layer's compiled training call, forward and backward."""
    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.cast(layer(x, training=True), tf.float32) * tf.cast(x, tf.float32))
        return tape.gradient(loss, x)

    return {op.type for op in step.get_concrete_function(x).graph.get_operations()}


# (input shape, dtype, layer arguments, kernels on?) -> which implementation the call must run.
IMPLEMENTATIONS = {
    "kernels_float32": ((8, 4, 4, 3), tf.float32, {}, True, "kernels"),
    "kernels_float16_cast": ((8, 4, 4, 3), tf.float16, {}, True, "kernels"),
    "kernels_per_rank": ((8, 4, 4, 3), tf.float32, {"synchronized": False}, True, "kernels"),
    "off_kernels_float32": ((8, 4, 4, 3), tf.float32, {}, False, "fused"),
    "off_kernels_float16": ((8, 4, 4, 3), tf.float16, {}, False, "fused"),
    "off_kernels_bfloat16_nchw": ((8, 3, 4, 4), tf.bfloat16, {"axis": 1}, False, "fused"),
    "off_kernels_small_epsilon": ((8, 4, 4, 3), tf.float32, {"epsilon": 1e-6}, False, "tf-ops"),
    "off_kernels_2d": ((8, 3), tf.float32, {}, False, "tf-ops"),
    "kernels_channels_first": ((8, 3, 4, 4), tf.float32, {"axis": 1}, True, "fused"),
}


@pytest.mark.parametrize("name", list(IMPLEMENTATIONS))
def test_each_call_runs_the_implementation_meant_for_it(name, monkeypatch):
    """At world size 1 (no collectives): hvdtrain's kernels where they serve the input (float32
    compute, channels-last, CPU); otherwise TensorFlow's fused batch norm for 4-D input, half
    precision included as it is; TensorFlow's element-wise ops for the rest."""
    shape, dtype, kwargs, use_kernels, expected = IMPLEMENTATIONS[name]
    if use_kernels and not sync_bn_kernels.available():
        pytest.fail("SyncBatchNormalization CPU kernels are not built (python -m hvdtrain.model.sync_bn_kernels)")
    monkeypatch.setattr(sync_bn_kernels, "available", lambda: use_kernels)
    layer = SyncBatchNormalization(**kwargs)
    ops = _training_ops(layer, tf.cast(tf.random.normal(shape), dtype))
    fused = {"FusedBatchNormV3", "FusedBatchNormGradV3"} <= ops
    kernels = {"HvdtrainSyncBnMoments", "HvdtrainSyncBnNormalize", "HvdtrainSyncBnGradSums",
               "HvdtrainSyncBnGradInput"} <= ops
    assert (fused, kernels) == {"fused": (True, False), "kernels": (False, True), "tf-ops": (False, False)}[expected], ops


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            return {flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    except OSError:
        return set()


@pytest.mark.skipif(platform.machine() != "x86_64" or "avx2" not in _cpu_flags(),
                    reason="the kernels are cloned for x86-64 CPUs with AVX2 or AVX-512")
def test_cpu_clones_compute_bit_for_bit_as_baseline_code(tmp_path):
    """The kernels' row loops run the widest clone this CPU has (AVX-512 or AVX2). The same source
    built as baseline x86-64 code alone, and as AVX2 code alone, must give bit-identical results
    (signed zeros included), so that a run does not depend on the CPU it ran on (and the
    recomputed ReLU mask matches the forward's)."""
    if not sync_bn_kernels.available():
        pytest.fail("SyncBatchNormalization CPU kernels are not built (python -m hvdtrain.model.sync_bn_kernels)")

    def symbols(library: str) -> str:
        return subprocess.run(["nm", library], capture_output=True, text=True, check=True).stdout

    installed = symbols(sync_bn_kernels.LIBRARY)
    assert ".avx512f" in installed and ".avx2" in installed, "the installed library has no CPU clones"
    libraries = {"installed (widest clone)": sync_bn_kernels.LIBRARY}
    for name, clones in [("baseline", ""), ("avx2 alone", '__attribute__((target("avx2")))')]:
        libraries[name] = str(tmp_path / f"{name.split()[0]}.so")
        subprocess.run(sync_bn_kernels.compile_command(libraries[name], defines=[f"HVDTRAIN_CPU_CLONES={clones}"]),
                       check=True, capture_output=True)
        assert ".avx" not in symbols(libraries[name]), f"the {name} build has clones"
    outputs = {}
    for name, library in libraries.items():
        out = tmp_path / f"{len(outputs)}.npz"
        worker = subprocess.run([sys.executable, "-m", "tests.workers.kernel_outputs", library, str(out)], cwd=REPO,
                                env=rank_env(), capture_output=True, text=True, timeout=120)
        assert worker.returncode == 0, worker.stderr[-3000:]
        outputs[name] = np.load(out)
    plain = outputs.pop("baseline")
    assert len(plain.files) == 28
    for name, got in outputs.items():
        assert sorted(got.files) == sorted(plain.files)
        for op in plain.files:
            assert got[op].dtype == plain[op].dtype and got[op].shape == plain[op].shape, (name, op)
            assert got[op].tobytes() == plain[op].tobytes(), f"{name}: {op} differs from the baseline code"


def test_kernels_built_from_another_source_are_not_loaded(monkeypatch, tmp_path):
    """A library left from an older source (a pull without re-running the set-up) may not match the
    calls: the layer warns and uses TensorFlow ops instead."""
    stamp = tmp_path / "stamp"
    stamp.write_text("tensorflow 2.15.1\nsource sha256 0\n")
    monkeypatch.setattr(sync_bn_kernels, "STAMP", str(stamp))
    sync_bn_kernels._library.cache_clear()
    try:
        with pytest.warns(UserWarning, match="was not built from this .* Rebuild with: python -m hvdtrain.model.sync_bn_kernels"):
            assert sync_bn_kernels._library() is None
        assert not sync_bn_kernels.available()
    finally:
        monkeypatch.undo()
        sync_bn_kernels._library.cache_clear()
    assert sync_bn_kernels.available()
