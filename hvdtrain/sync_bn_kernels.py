"""Single-pass CPU kernels for :class:`hvdtrain.SyncBatchNormalization`: build, load, call.

The kernels (``hvdtrain/csrc/sync_bn_kernels.cc``) are compiled against the installed TensorFlow by
``python -m hvdtrain.sync_bn_kernels`` (run by ``scripts/setup.sh``). Without them, or on a process
that sees a GPU, or with ``HVDTRAIN_SYNC_BN_KERNELS=0``, the layer uses TensorFlow ops that compute
the same quantities (the moments in two float32 passes instead of one float64 pass).

All tensors are float32 with channels on the last axis, except the float64 shifts and sums.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import warnings

import tensorflow as tf

_HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(_HERE, "csrc", "sync_bn_kernels.cc")
LIBRARY = os.path.join(_HERE, "_sync_bn_kernels.so")


@functools.lru_cache(maxsize=None)
def _library():
    if os.environ.get("HVDTRAIN_SYNC_BN_KERNELS", "1") == "0" or not os.path.exists(LIBRARY):
        return None
    try:
        return tf.load_op_library(LIBRARY)
    except (tf.errors.NotFoundError, OSError) as e:  # built against another TensorFlow, say
        warnings.warn(f"hvdtrain: cannot load {LIBRARY} ({e}); SyncBatchNormalization uses TensorFlow ops. "
                      f"Rebuild with: python -m hvdtrain.sync_bn_kernels")
        return None


def available() -> bool:
    """True when the kernels are loaded and this process computes on the CPU (sees no GPU)."""
    return _library() is not None and not tf.config.list_logical_devices("GPU")


def moments(x, shift):
    """Per channel ``Σ(x - shift)`` and ``Σ(x - shift)²`` of float32 ``x[..., C]``; float64 ``[C]`` each."""
    return _library().hvdtrain_sync_bn_moments(x, shift)


def normalize(x, mean_hi, scale, offset):
    """``(x - mean_hi) · scale + offset`` per channel; float32, the shape of ``x``."""
    return _library().hvdtrain_sync_bn_normalize(x, mean_hi, scale, offset)


def grad_sums(dy, x, mean_hi):
    """Per channel ``Σdy`` and ``Σdy·(x - mean_hi)``; float64 ``[C]`` each."""
    return _library().hvdtrain_sync_bn_grad_sums(dy, x, mean_hi)


def grad_input(dy, x, mean_hi, a, b, c):
    """``a·dy + b·(x - mean_hi) + c`` per channel; float32, the shape of ``x``."""
    return _library().hvdtrain_sync_bn_grad_input(dy, x, mean_hi, a, b, c)


@tf.RegisterGradient("HvdtrainSyncBnNormalize")
def _normalize_grad(op, dy):
    """Gradient of ``y = (x - mean_hi) · scale + offset`` with respect to all four inputs.

    The training path differentiates the whole layer with its own custom gradient; this one serves
    the inference path (``training=False``, or a frozen layer) inside a model being trained.
    """
    x, mean_hi, scale, _ = op.inputs
    sum_dy, sum_dy_centered = grad_sums(dy, x, mean_hi)
    sum_dy = tf.cast(sum_dy, tf.float32)
    zeros = tf.zeros_like(scale)
    return (grad_input(dy, x, mean_hi, scale, zeros, zeros), -scale * sum_dy, tf.cast(sum_dy_centered, tf.float32),
            sum_dy)


def build(force: bool = False) -> str:
    """Compile the kernels against the installed TensorFlow (skipped when up to date).

    Returns:
        The path of the shared library.

    Raises:
        subprocess.CalledProcessError: if the compiler fails.
    """
    stamp = LIBRARY + ".tf-version"
    up_to_date = (os.path.exists(LIBRARY) and os.path.getmtime(LIBRARY) >= os.path.getmtime(SOURCE)
                  and os.path.exists(stamp) and open(stamp).read() == tf.__version__)
    if up_to_date and not force:
        return LIBRARY
    # No -march=native: the library may be shared by hosts with different CPUs (one image, one file
    # system); the kernels are memory-bound, so baseline x86-64 vector code loses little.
    cmd = [os.environ.get("CXX", "g++"), "-shared", "-fPIC", "-O3", *tf.sysconfig.get_compile_flags(),
           SOURCE, "-o", LIBRARY + ".tmp", *tf.sysconfig.get_link_flags()]
    subprocess.run(cmd, check=True)
    os.replace(LIBRARY + ".tmp", LIBRARY)
    with open(stamp, "w") as f:
        f.write(tf.__version__)
    return LIBRARY


if __name__ == "__main__":
    print(f"[setup] SyncBatchNormalization CPU kernels: {build(force='--force' in sys.argv)}")
