"""Single-pass CPU kernels for :class:`hvdtrain.SyncBatchNormalization`: build, load, call.

The kernels (``hvdtrain/model/csrc/sync_bn_kernels.cc``) are compiled against the installed TensorFlow by
``python -m hvdtrain.model.sync_bn_kernels`` (run by ``scripts/setup.sh``). Without them, or on a process
that sees a GPU, or with ``HVDTRAIN_SYNC_BN_KERNELS=0`` (or :func:`set_enabled`, as ``--no-sync-bn-kernels`` does), the layer uses TensorFlow ops that compute
the same quantities (the moments in two float32 passes instead of one float64 pass).

All tensors are float32 with channels on the last axis, except the float64 shifts and sums.
"""
from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import sys
import warnings
from typing import List, Sequence

import tensorflow as tf

from hvdtrain.console import say

_HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(_HERE, "csrc", "sync_bn_kernels.cc")
# One library per TensorFlow version, so that stacks sharing this checkout (scripts/matrix.sh) keep their own.
LIBRARY = os.path.join(_HERE, f"_sync_bn_kernels.tf{tf.__version__}.so")
STAMP = LIBRARY + ".stamp"  # what the library was built from: TensorFlow's version and the source's hash


def _build_inputs() -> str:
    with open(SOURCE, "rb") as f:
        return f"tensorflow {tf.__version__}\nsource sha256 {hashlib.sha256(f.read()).hexdigest()}\n"


def _stamp_matches() -> bool:
    """True when the library was built by :func:`build` from this source for this TensorFlow."""
    try:
        with open(STAMP) as f:
            return f.read() == _build_inputs()
    except OSError:
        return False


_enabled = os.environ.get("HVDTRAIN_SYNC_BN_KERNELS", "1") != "0"


def set_enabled(enabled: bool) -> None:
    """Use the kernels where available (True, the default unless ``HVDTRAIN_SYNC_BN_KERNELS=0``)
    or TensorFlow ops (False). Call before the layer first runs: compiled steps keep what they traced."""
    global _enabled
    _enabled = bool(enabled)
    _library.cache_clear()


@functools.lru_cache(maxsize=None)
def _library():
    if not _enabled:
        return None
    if not os.path.exists(LIBRARY):  # an install without scripts/setup.sh (pip install .): said once, by rank 0
        from hvdtrain.runtime.launcher import launcher_rank

        if launcher_rank() == 0:
            say(f"hvdtrain: note: SyncBatchNormalization's CPU kernels are not built for TensorFlow {tf.__version__}; "
                f"it uses TensorFlow ops, which compute the same, more slowly. Build them once with: "
                f"python -m hvdtrain.model.sync_bn_kernels", sys.stderr)
        return None
    if not _stamp_matches():  # built from another source, or for another TensorFlow: its ops may not match
        warnings.warn(f"hvdtrain: {LIBRARY} was not built from this {SOURCE} for TensorFlow {tf.__version__}; "
                      f"SyncBatchNormalization uses TensorFlow ops. Rebuild with: python -m hvdtrain.model.sync_bn_kernels")
        return None
    try:
        return tf.load_op_library(LIBRARY)
    except (tf.errors.NotFoundError, OSError) as e:  # built against another TensorFlow, say
        warnings.warn(f"hvdtrain: cannot load {LIBRARY} ({e}); SyncBatchNormalization uses TensorFlow ops. "
                      f"Rebuild with: python -m hvdtrain.model.sync_bn_kernels")
        return None


def available() -> bool:
    """True when the kernels are loaded and this process computes on the CPU (sees no GPU)."""
    return _library() is not None and not tf.config.list_logical_devices("GPU")


def moments(x, shift):
    """Per channel ``Σ(x - shift)`` and ``Σ(x - shift)²`` of float32 ``x[..., C]``; float64 ``[C]`` each."""
    return _library().hvdtrain_sync_bn_moments(x, shift)


def normalize(x, mean_hi, scale, offset, relu=False):
    """``z = (x - mean_hi) · scale + offset`` per channel, or ``max(z, 0)`` with ``relu``; float32, the shape of ``x``."""
    return _library().hvdtrain_sync_bn_normalize(x, mean_hi, scale, offset, relu=relu)


def grad_sums(dy, x, mean_hi, scale, offset, relu=False):
    """Per channel ``Σg`` and ``Σg·(x - mean_hi)``; float64 ``[C]`` each.

    ``g = dy``, or with ``relu`` ``dy`` where ``z = (x - mean_hi) · scale + offset > 0`` and 0
    elsewhere: the gradient that reaches a fused :func:`normalize` ``(..., relu=True)``'s ``z``.
    """
    return _library().hvdtrain_sync_bn_grad_sums(dy, x, mean_hi, scale, offset, relu=relu)


def grad_input(dy, x, mean_hi, scale, offset, b, c, relu=False):
    """``scale·g + b·(x - mean_hi) + c`` per channel, ``g`` as in :func:`grad_sums`; float32, the shape of ``x``."""
    return _library().hvdtrain_sync_bn_grad_input(dy, x, mean_hi, scale, offset, b, c, relu=relu)


@tf.RegisterGradient("HvdtrainSyncBnNormalize")
def _normalize_grad(op, dy):
    """Gradient of ``y = [max(0,] (x - mean_hi) · scale + offset [)]`` with respect to all four inputs.

    The training path differentiates the whole layer with its own custom gradient; this one serves
    the inference path (``training=False``, or a frozen layer) inside a model being trained.
    """
    x, mean_hi, scale, offset = op.inputs
    relu = op.get_attr("relu")
    sum_dy, sum_dy_centered = grad_sums(dy, x, mean_hi, scale, offset, relu=relu)
    sum_dy = tf.cast(sum_dy, tf.float32)
    zeros = tf.zeros_like(scale)
    return (grad_input(dy, x, mean_hi, scale, offset, zeros, zeros, relu=relu), -scale * sum_dy,
            tf.cast(sum_dy_centered, tf.float32), sum_dy)


def compile_command(output: str, defines: Sequence[str] = ()) -> List[str]:
    """The compiler command that builds the kernels into ``output``; ``defines`` are extra ``-D``
    macros (``HVDTRAIN_CPU_CLONES=``: baseline x86-64 code alone, for tests)."""
    # No -march=native: the library may be shared by hosts with different CPUs (one image, one file
    # system); the source's row loops are cloned for AVX-512 and AVX2 instead, and the loader picks
    # the widest the CPU has (see the source).
    # -ffp-contract=off: no fused multiply-add, so the backward ops' recomputed pre-ReLU value is
    # bit-identical to the forward op's, and the ReLU mask with it (and every clone computes alike).
    # -fno-trapping-math: GCC may then compute the ReLU mask branch-free, so those loops vectorize
    # (TensorFlow traps no floating-point exceptions; results are unchanged).
    return [os.environ.get("CXX", "g++"), "-shared", "-fPIC", "-O3", "-ffp-contract=off", "-fno-trapping-math",
            *(f"-D{d}" for d in defines), *tf.sysconfig.get_compile_flags(),
            SOURCE, "-o", output, *tf.sysconfig.get_link_flags()]


def build(force: bool = False) -> str:
    """Compile the kernels against the installed TensorFlow (skipped when up to date).

    Returns:
        The path of the shared library.

    Raises:
        subprocess.CalledProcessError: if the compiler fails.
    """
    if os.path.exists(LIBRARY) and _stamp_matches() and not force:
        return LIBRARY
    subprocess.run(compile_command(LIBRARY + ".tmp"), check=True)
    os.replace(LIBRARY + ".tmp", LIBRARY)
    with open(STAMP, "w") as f:
        f.write(_build_inputs())
    return LIBRARY


if __name__ == "__main__":
    print(f"[setup] SyncBatchNormalization CPU kernels: {build(force='--force' in sys.argv)}")
