"""IDX directories and NPZ files made for a test, and damaged on purpose."""
import gzip

import numpy as np


def write_idx(path, array, gz=False):
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    data = header + array.astype(np.uint8).tobytes()
    with (gzip.open if gz else open)(path, "wb") as f:
        f.write(data)


def make_idx_dir(root, n_train=20, n_test=10, gz=False, labels=None):
    rng = np.random.default_rng(0)
    suffix = ".gz" if gz else ""
    write_idx(root / f"train-images-idx3-ubyte{suffix}", rng.integers(0, 256, (n_train, 5, 4)), gz)
    write_idx(root / f"train-labels-idx1-ubyte{suffix}", labels if labels is not None else np.arange(n_train) % 3, gz)
    write_idx(root / f"t10k-images-idx3-ubyte{suffix}", rng.integers(0, 256, (n_test, 5, 4)), gz)
    write_idx(root / f"t10k-labels-idx1-ubyte{suffix}", np.arange(n_test) % 3, gz)
    return root


def corrupt(path, how):
    raw = open(path, "rb").read()
    if how == "magic":
        raw = b"\x12\x34" + raw[2:]
    elif how == "truncated":
        raw = raw[:-7]
    elif how == "dims":
        raw = raw[:3] + bytes([2]) + raw[4:]
    open(path, "wb").write(raw)


def save_npz(path, **overrides):
    rng = np.random.default_rng(1)
    arrays = dict(x_train=rng.integers(0, 256, (12, 6, 6), dtype=np.uint8), y_train=np.arange(12) % 4,
                  x_test=rng.integers(0, 256, (5, 6, 6), dtype=np.uint8), y_test=np.arange(5) % 4)
    arrays.update(overrides)
    np.savez(path, **{k: v for k, v in arrays.items() if v is not None})
    return str(path)
