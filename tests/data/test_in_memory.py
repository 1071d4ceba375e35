"""Loaders: real Fashion-MNIST IDX files, gzip and raw IDX, NPZ files, synthetic data, and clear errors."""
import os

import numpy as np
import pytest

from hvdtrain.config import DEFAULT_DATA_DIR
from hvdtrain.data.in_memory import load_dataset, load_idx_dir, load_npz, make_synthetic
from hvdtrain.errors import HvdtrainError
from tests.helpers.idx_files import corrupt, make_idx_dir, save_npz, write_idx


@pytest.mark.skipif(not os.path.isdir(DEFAULT_DATA_DIR), reason="Debian's dataset-fashion-mnist is not installed")
def test_real_fashion_mnist():
    d = load_dataset("idx", DEFAULT_DATA_DIR)
    assert d.x_train.shape == (60000, 28, 28, 1) and d.x_test.shape == (10000, 28, 28, 1)
    assert d.x_train.dtype == np.uint8 and d.num_classes == 10
    assert np.bincount(d.y_train).tolist() == [6000] * 10


@pytest.mark.parametrize("gz", [False, True])
def test_idx_raw_and_gzip(tmp_path, gz):
    d = load_idx_dir(make_idx_dir(tmp_path, gz=gz))
    assert d.x_train.shape == (20, 5, 4, 1) and d.y_train.dtype == np.int32 and d.num_classes == 3


@pytest.mark.parametrize("how, message", [("magic", "bad magic number"), ("truncated", "truncated"),
                                          ("dims", "images must have 3 dimensions")])
def test_corrupt_idx(tmp_path, how, message):
    make_idx_dir(tmp_path)
    if how == "dims":  # a 2-D file where a 3-D one belongs, with a consistent size
        arr = np.zeros((20, 20), np.uint8)
        write_idx(tmp_path / "train-images-idx3-ubyte", arr)
    else:
        corrupt(tmp_path / "train-images-idx3-ubyte", how)
    with pytest.raises(HvdtrainError, match=message):
        load_idx_dir(tmp_path)


def test_idx_count_mismatch_and_missing(tmp_path):
    make_idx_dir(tmp_path, labels=np.arange(19) % 3)
    with pytest.raises(HvdtrainError, match="20 images but 19 labels"):
        load_idx_dir(tmp_path)
    os.remove(tmp_path / "t10k-labels-idx1-ubyte")
    with pytest.raises(HvdtrainError, match="missing t10k-labels-idx1-ubyte"):
        load_idx_dir(tmp_path)
    with pytest.raises(HvdtrainError, match="does not exist"):
        load_idx_dir(tmp_path / "nope")


def test_npz_keras_layout(tmp_path):
    d = load_npz(save_npz(tmp_path / "d.npz"))
    assert d.x_train.shape == (12, 6, 6, 1) and d.num_classes == 4
    d = load_npz(save_npz(tmp_path / "f.npz", x_train=np.ones((12, 6, 6, 3), np.float64),
                          x_test=np.ones((5, 6, 6, 3), np.float64), y_train=(np.arange(12) % 4)[:, None]))
    assert d.x_train.dtype == np.float32 and d.input_shape == (6, 6, 3) and d.y_train.shape == (12,)


@pytest.mark.parametrize("overrides, message", [
    (dict(y_test=None), r"missing key\(s\) \['y_test'\]"),
    (dict(x_train=np.array([object()] * 12, dtype=object)), "cannot load without unpickling"),
    (dict(y_train=np.arange(12, dtype=np.float32)),
     r"y_train must be integer class labels, got dtype float32 holding whole numbers: cast it to an integer dtype"),
    (dict(y_train=np.r_[np.arange(11), 3.5].astype(np.float32)),
     r"got dtype float32, and y_train\[11\] \(0-based\) holds 3.5, not a class index"),
    (dict(x_train=np.zeros((12, 6), np.uint8)), r"x_train must have shape \(n, H, W\[, C\]\)"),
    (dict(y_train=np.arange(11)), "12 images but 11 labels"),
    (dict(y_train=np.arange(12) - 1), r"labels must be in \[0, 11\), found range \[-1, 10\]: -1 at y_train\[0\], 0-based"),
    # The largest label is named where it is: in the test split.
    (dict(y_test=np.r_[np.arange(4), 11]), r"the labels go up to 11 \(at y_test\[4\], 0-based\), but no training"),
    (dict(x_train=np.zeros((0, 6, 6), np.uint8), y_train=np.zeros(0, np.int64)), "empty dataset"),
    (dict(x_train=np.r_[np.zeros((7, 6, 6)), np.full((5, 6, 6), np.nan)]), r"NaN or Inf .*: example 7 \(0-based\) holds nan"),
    (dict(x_test=np.full((5, 6, 6), 1e39)), r"x_test contains NaN or Inf \(or values beyond float32's range"),
    # A corrupt label far beyond the classes is named without counting up to it.
    (dict(y_train=np.r_[np.arange(11) % 4, 2 ** 40]),
     r"the labels go up to 1099511627776 \(at y_train\[11\], 0-based\), but no training example has class 4, 5, 6, 7, "
     r"8 and 1099511627767 more"),
])
def test_npz_errors(tmp_path, overrides, message):
    with pytest.raises(HvdtrainError, match=message):
        load_npz(save_npz(tmp_path / "bad.npz", **overrides))


def test_npz_not_a_zip(tmp_path):
    path = tmp_path / "junk.npz"
    path.write_bytes(b"not a zip file")
    with pytest.raises(HvdtrainError, match="cannot read NPZ file"):
        load_npz(str(path))


def test_npz_with_a_damaged_compressed_member(tmp_path):
    """Deflate data damaged inside the archive: zlib's or zipfile's error, reported as ours."""
    path = tmp_path / "damaged.npz"
    rng = np.random.default_rng(0)
    np.savez_compressed(path, x_train=rng.integers(0, 4, (200, 6, 6), dtype=np.uint8), y_train=np.arange(200) % 4,
                        x_test=np.zeros((5, 6, 6), np.uint8), y_test=np.arange(5) % 4)
    raw = bytearray(path.read_bytes())
    start = raw.index(b"x_train.npy") + 200  # inside the first member's compressed data
    raw[start:start + 64] = bytes(64)
    path.write_bytes(bytes(raw))
    with pytest.raises(HvdtrainError, match="cannot read NPZ file"):
        load_npz(str(path))


def test_synthetic_is_learnable_and_deterministic():
    a, b = make_synthetic(seed=3), make_synthetic(seed=3)
    assert np.array_equal(a.x_train, b.x_train) and np.array_equal(a.y_train, b.y_train)
    assert not np.array_equal(a.x_train, make_synthetic(seed=4).x_train)
    assert len(np.unique(a.y_train)) == 10
    # Learnable: a least-squares linear classifier fit on the training set beats chance (0.1) on the test set.
    def features(x):
        return np.c_[x.reshape(len(x), -1).astype(np.float64), np.ones(len(x))]

    weights = np.linalg.lstsq(features(a.x_train), np.eye(10)[a.y_train], rcond=None)[0]
    predicted = (features(a.x_test) @ weights).argmax(axis=1)
    assert np.mean(predicted == a.y_test) > 0.4
