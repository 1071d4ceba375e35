"""The oracle tolerance: N ranks with local batch B must end with the weights of one process on the
global batch N*B, to ||w_ranks - w_oracle|| <= 1e-5 ||w_oracle|| per tensor."""
import numpy as np

REL_TOL = 1e-5


def assert_same_weights(ours: dict, oracle: dict, prefix: str = "final/", tol: float = REL_TOL) -> None:
    """Compare every tensor of ``oracle`` whose key starts with ``prefix`` (at least one) by norm.

    Raises:
        AssertionError: naming the first tensor with ``||ours - oracle|| > tol * ||oracle||``.
    """
    keys = sorted(k for k in oracle if k.startswith(prefix))
    assert keys, f"no weights under {prefix!r}"
    for k in keys:
        delta = np.linalg.norm(ours[k] - oracle[k])
        norm = np.linalg.norm(oracle[k])
        assert delta <= tol * max(norm, 1e-12), f"{k}: |dw| = {delta:.3g}, |w| = {norm:.3g}"
