"""The oracle tolerance: N ranks with local batch B must end with the weights of one process on the
global batch N*B, per tensor to ``||w_ranks - w_oracle|| <= tol ||w_oracle||``.

In float64 (``--precision fp64``) the two runs differ only by rounding near 1e-16, amplified by
the steps to about 1e-14 (measured on the suite's models, oneDNN on and off): 1e-12 leaves no room
for a real discrepancy, which moves weights by far more. In float32 the same rounding starts near
6e-8 and reaches about 1e-6 after the suite's 10 steps (oneDNN's kernels on or off): 1e-5.
"""
import numpy as np

REL_TOL = 1e-5  # float32
REL_TOL_FP64 = 1e-12


def tolerance(weights: dict) -> float:
    """The tolerance for ``weights``: :data:`REL_TOL_FP64` if every floating tensor is float64."""
    floats = [w for w in weights.values() if np.asarray(w).dtype.kind == "f"]
    return REL_TOL_FP64 if floats and all(np.asarray(w).dtype == np.float64 for w in floats) else REL_TOL


def assert_same_weights(ours: dict, oracle: dict, prefix: str = "final/", tol: float = None, dtype=None) -> None:
    """Compare every tensor of ``oracle`` whose key starts with ``prefix`` (at least one) by norm,
    to ``tol`` (default: :func:`tolerance` of the oracle's tensors under ``prefix``). ``dtype``:
    every floating tensor compared must be of it (a float64 run that silently ran in float32
    would otherwise be held to float32's tolerance).

    Raises:
        AssertionError: naming the first tensor with ``||ours - oracle|| > tol * ||oracle||``.
    """
    keys = sorted(k for k in oracle if k.startswith(prefix))
    assert keys, f"no weights under {prefix!r}"
    if dtype is not None:
        wrong = [k for k in keys if oracle[k].dtype.kind == "f" and oracle[k].dtype != dtype]
        assert not wrong, f"{wrong[0]} is {oracle[wrong[0]].dtype}, not {np.dtype(dtype)}"
    if tol is None:
        tol = tolerance({k: oracle[k] for k in keys})
    for k in keys:
        assert ours[k].dtype == oracle[k].dtype, f"{k}: {ours[k].dtype} against the oracle's {oracle[k].dtype}"
        delta = np.linalg.norm(ours[k] - oracle[k])
        norm = np.linalg.norm(oracle[k])
        assert delta <= tol * max(norm, 1e-12), f"{k}: |dw| = {delta:.3g}, |w| = {norm:.3g} (tolerance {tol:g})"
