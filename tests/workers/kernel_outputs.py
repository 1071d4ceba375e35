"""Worker: every op of a SyncBatchNormalization kernel library, on fixed inputs; saves the outputs.

Usage: python -m tests.workers.kernel_outputs LIBRARY OUT.npz
One library per process: two libraries registering the same ops cannot share one.
"""
import sys

import numpy as np
import tensorflow as tf

# Shapes whose channel counts and row counts are, and are not, multiples of the vector widths and
# of the kernels' 256-row blocks; the last one with |mean| >> std, as on a first step.
SHAPES = [(7, 5, 3), (300, 17), (4, 28, 28, 32), (513, 64)]


def main(library: str, out: str) -> None:
    ops = tf.load_op_library(library)
    rng = np.random.default_rng(0)
    outputs = {}
    for i, shape in enumerate(SHAPES):
        channels, far = shape[-1], 1e3 * (i == len(SHAPES) - 1)
        x = (rng.normal(size=shape) * 3 + far).astype(np.float32)
        dy = rng.normal(size=shape).astype(np.float32)
        shift = rng.normal(size=channels)
        mean_hi = (rng.normal(size=channels) + far).astype(np.float32)
        scale, offset, b, c = (rng.normal(size=channels).astype(np.float32) for _ in range(4))
        outputs[f"{i} moments"] = np.stack(ops.hvdtrain_sync_bn_moments(x, shift))
        for relu in (False, True):
            outputs[f"{i} normalize {relu}"] = ops.hvdtrain_sync_bn_normalize(x, mean_hi, scale, offset, relu=relu)
            outputs[f"{i} grad_sums {relu}"] = np.stack(
                ops.hvdtrain_sync_bn_grad_sums(dy, x, mean_hi, scale, offset, relu=relu))
            outputs[f"{i} grad_input {relu}"] = ops.hvdtrain_sync_bn_grad_input(
                dy, x, mean_hi, scale, offset, b, c, relu=relu)
    np.savez(out, **{k: np.asarray(v) for k, v in outputs.items()})


if __name__ == "__main__":
    main(*sys.argv[1:])
