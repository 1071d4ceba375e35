"""Rank worker: run SyncBatchNormalization (and Horovod's layer) on each test case; save per-rank results.

Usage: python -m tests.workers.sync_bn_cases OUT_DIR
Writes OUT_DIR/rank<r>.npz with ``<case>/<key>`` arrays: y, dx, dgamma, dbeta, moving_mean,
moving_variance (ours; a masked case's mask is :func:`case_mask`'s); the same as ``per_rank/<case>/<key>`` from the layer with
``synchronized=False``; ``<case>/hvd_y`` (Horovod's layer, uneven case only); and ``kernels``
(whether this rank ran hvdtrain's CPU kernels or TensorFlow's ops).
"""
import sys

import numpy as np

from hvdtrain.runtime.dist import init_distributed


def cases(world_size: int) -> dict:
    """name -> dict(shape=per-example shape, axis, sizes per rank, loc, scale[, activation]). Same on every rank."""
    r = world_size
    uneven = [3, 13, 6, 9][:r]
    return {
        "equal_nhwc": dict(shape=(3, 3, 4), axis=-1, sizes=[4] * r, loc=0.5, scale=2.0),
        "uneven": dict(shape=(2, 2, 3), axis=-1, sizes=uneven, loc=-1.0, scale=0.5),
        "one_empty": dict(shape=(2, 2, 3), axis=-1, sizes=[0] + [5] * (r - 1), loc=0.0, scale=1.0),
        "offset_1e4": dict(shape=(6,), axis=-1, sizes=[16] * r, loc=1e4, scale=1.0),
        "rank2": dict(shape=(7,), axis=-1, sizes=[5] * r, loc=3.0, scale=0.1),
        "rank3": dict(shape=(4, 5), axis=-1, sizes=[3] * r, loc=0.0, scale=3.0),
        "channels_first": dict(shape=(4, 3, 3), axis=1, sizes=[2] * r, loc=1.0, scale=1.0),
        # The fused ReLU: on the CPU kernels (channels-last) and on the TensorFlow ops (channels-first).
        "relu_uneven": dict(shape=(3, 3, 4), axis=-1, sizes=uneven, loc=0.5, scale=2.0, activation="relu"),
        "relu_channels_first": dict(shape=(4, 3, 3), axis=1, sizes=[3] * r, loc=1.0, scale=1.0, activation="relu"),
        # Mixed precision: float16 input whose E[x^2] (1e6) is past float16's range (65504).
        "float16_offset_1e3": dict(shape=(3, 3, 4), axis=-1, sizes=uneven, loc=1e3, scale=1.0, dtype="float16"),
        # Masks (Keras': the input's shape without the channel axis): about half the positions
        # kept; in "masked_rank0_all_masked" none of rank 0's, so its examples count nowhere.
        "masked_sequence": dict(shape=(6, 3), axis=-1, sizes=uneven, loc=2.0, scale=1.5, mask=0.5),
        "masked_nhwc_relu": dict(shape=(3, 3, 4), axis=-1, sizes=[4] * r, loc=0.5, scale=2.0, mask=0.6,
                                 activation="relu"),
        "masked_rank0_all_masked": dict(shape=(5, 2), axis=-1, sizes=uneven, loc=-3.0, scale=0.5, mask=0.5,
                                        masked_ranks=(0,)),
    }

# Run as a compiled tf.function (as in training); the other cases run eagerly.
GRAPH_CASES = ("equal_nhwc", "relu_uneven", "masked_sequence")


def case_mask(name: str, case: dict):
    """The global boolean mask of a masked case (shape: the input's without its channel axis), or None."""
    if "mask" not in case:
        return None
    rng = np.random.default_rng(sum(map(ord, name)) + 1)
    n = sum(case["sizes"])
    mask = rng.uniform(size=(n, *case["shape"][:-1])) < case["mask"]
    starts = np.cumsum([0] + case["sizes"])
    for rank in case.get("masked_ranks", ()):
        mask[starts[rank]:starts[rank + 1]] = False
    return mask


def case_data(name: str, case: dict):
    """Global float32 input, upstream-gradient weights, gamma and beta for a case (seeded by its name);
    for a float16 case, input and weights are float16 values."""
    rng = np.random.default_rng(sum(map(ord, name)))
    n = sum(case["sizes"])
    x = (case["loc"] + case["scale"] * rng.standard_normal((n, *case["shape"]))).astype(np.float32)
    w = rng.standard_normal(x.shape).astype(np.float32)
    channels = case["shape"][case["axis"]] if case["axis"] != 1 else case["shape"][0]
    gamma = (1.0 + 0.3 * rng.standard_normal(channels)).astype(np.float32)
    if case.get("activation"):
        gamma[0] = -gamma[0]  # the ReLU mask then depends on gamma's sign too
    beta = (0.2 * rng.standard_normal(channels)).astype(np.float32)
    if case.get("dtype") == "float16":  # the values the layer gets, so the oracle has them too
        x, w = (a.astype(np.float16).astype(np.float32) for a in (x, w))
    return x, w, gamma, beta


def main(out_dir: str) -> None:
    ctx = init_distributed(threads=1)
    import tensorflow as tf
    import horovod.tensorflow as hvd
    from hvdtrain.keras2 import SyncBatchNormalization
    from hvdtrain.model import sync_bn_kernels

    results = {}
    for name, case in cases(ctx.size).items():
        x, w, gamma, beta = case_data(name, case)
        start = sum(case["sizes"][:ctx.rank])
        sl = slice(start, start + case["sizes"][ctx.rank])
        dtype = case.get("dtype", "float32")
        x_local, w_local = tf.constant(x[sl], dtype), tf.constant(w[sl], dtype)
        mask = case_mask(name, case)
        mask_local = None if mask is None else tf.constant(mask[sl])
        for prefix, synchronized in (("", True), ("per_rank/", False)):
            layer = SyncBatchNormalization(axis=case["axis"], momentum=0.9, epsilon=1e-3,
                                           activation=case.get("activation"), synchronized=synchronized)
            layer.build(x_local.shape)
            layer.gamma.assign(gamma)
            layer.beta.assign(beta)

            def forward_backward(x_in, layer=layer):
                with tf.GradientTape() as tape:
                    tape.watch(x_in)
                    y = layer(x_in, training=True, mask=mask_local)
                    loss = tf.reduce_sum(y * w_local)
                return (y, *tape.gradient(loss, [x_in, layer.gamma, layer.beta]))

            fn = tf.function(forward_backward) if name in GRAPH_CASES else forward_backward
            y, dx, dgamma, dbeta = fn(x_local)
            key = prefix + name
            results.update({f"{key}/y": y.numpy(), f"{key}/dx": dx.numpy(), f"{key}/dgamma": dgamma.numpy(),
                            f"{key}/dbeta": dbeta.numpy(), f"{key}/moving_mean": layer.moving_mean.numpy(),
                            f"{key}/moving_variance": layer.moving_variance.numpy()})
        if name == "uneven":
            theirs = hvd.SyncBatchNormalization(axis=case["axis"], momentum=0.9, epsilon=1e-3, name="hvd_sync_bn")
            theirs.build(x_local.shape)
            theirs.gamma.assign(gamma)
            theirs.beta.assign(beta)
            results[f"{name}/hvd_y"] = theirs(x_local, training=True).numpy()
    results["kernels"] = np.array(sync_bn_kernels.available())  # which path this rank computed with
    np.savez(f"{out_dir}/rank{ctx.rank}.npz", **results)
    ctx.close()


if __name__ == "__main__":
    main(sys.argv[1])
