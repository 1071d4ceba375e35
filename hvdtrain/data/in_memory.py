"""Datasets: MNIST-family IDX files, keras.datasets-style NPZ files, and synthetic data.

Every loader returns a validated :class:`Dataset` or raises :class:`HvdtrainError` naming the file and
what is wrong with it. Nothing is unpickled: NPZ files are read with ``allow_pickle=False``.
"""
from __future__ import annotations

import dataclasses
import gzip
import hashlib
import os
import zipfile
import zlib
from typing import Optional, Tuple

import numpy as np

from hvdtrain.config import CLASSES, TARGETS
from hvdtrain.data.labels import check_finite, check_labels, not_integer_labels
from hvdtrain.errors import HvdtrainError, describe_differences

# IDX type codes (http://yann.lecun.com/exdb/mnist/, "THE IDX FILE FORMAT") -> big-endian dtypes.
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_IDX_FILES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}


@dataclasses.dataclass(frozen=True)
class Dataset:
    """An in-memory dataset of images and their labels.

    Attributes:
        x_train: images, shape ``(n_train, H, W, C)``, dtype uint8 (pixels 0-255) or float32.
        y_train: labels ``(n_train, ...)``: int32 class indices in ``[0, num_classes)`` (one per
            image, or a map of one per pixel ``(n_train, H', W')`` for segmentation), or float32
            targets (``labels == "targets"``).
        x_test: images, shape ``(n_test, H, W, C)``, same dtype as ``x_train``.
        y_test: labels ``(n_test, ...)``, as ``y_train``.
        num_classes: ``K``, the model's outputs per label: the class count, or for targets the
            size of their last axis (1 for scalar targets).
        name: where it came from, for the banner.
        labels: ``"classes"`` or ``"targets"`` (:data:`hvdtrain.losses.CLASSES`, ``TARGETS``).
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    name: str
    labels: str = CLASSES

    @property
    def input_shape(self) -> Tuple[int, int, int]:
        """``(H, W, C)`` of one image."""
        return tuple(self.x_train.shape[1:])

    @property
    def label_shape(self) -> Tuple[int, ...]:
        """The shape of one example's label: ``()`` for one class index or scalar target."""
        return tuple(self.y_train.shape[1:])

    @property
    def num_train(self) -> int:
        """Training examples."""
        return len(self.y_train)

    @property
    def num_test(self) -> int:
        """Test examples."""
        return len(self.y_test)

    def fingerprint(self) -> dict:
        """What every rank of a job must agree on: sizes, image shape and dtype, classes, and a
        BLAKE2b digest (hex, 128 bits) of all images and labels. About 0.1 s for Fashion-MNIST."""
        digest = hashlib.blake2b(digest_size=16)
        for array in (self.x_train, self.y_train, self.x_test, self.y_test):
            digest.update(np.ascontiguousarray(array).data)
        return {"train_examples": len(self.y_train), "test_examples": len(self.y_test),
                "image_shape": list(self.input_shape), "dtype": str(self.x_train.dtype),
                "num_classes": int(self.num_classes), **self._label_fingerprint(), "digest": digest.hexdigest()}

    def _label_fingerprint(self) -> dict:
        """Labels other than one class index per image (so that older fingerprints stay the same)."""
        if self.labels == CLASSES and not self.label_shape:
            return {}
        return {"labels": self.labels, "label_shape": list(self.label_shape)}


def data_mismatch(rank: int, fingerprint: dict, chief: dict) -> HvdtrainError:
    """The error for a rank whose :meth:`Dataset.fingerprint` differs from rank 0's, naming what differs."""
    differ = "; ".join(describe_differences(fingerprint, chief, "on rank 0"))
    return HvdtrainError(f"rank {rank} loaded other data than rank 0 ({differ}); every rank must read the same "
                         f"dataset (the same files on every host)")


# ---- IDX -----------------------------------------------------------------------------------------
def read_idx(path: str) -> np.ndarray:
    """Read one IDX file (raw or gzip-compressed) into a numpy array.

    Args:
        path: file path; a ``.gz`` suffix or gzip magic selects decompression.

    Returns:
        Array of the file's shape, in native byte order (``uint8`` for MNIST images and labels).

    Raises:
        HvdtrainError: if the file cannot be read, its magic number is not IDX, or its size does not
            match the dimensions in its header (truncated or trailing bytes).
    """
    try:
        with open(path, "rb") as f:
            raw = f.read()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise HvdtrainError(f"cannot read IDX file {path}: {e}") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES or raw[3] == 0:
        raise HvdtrainError(f"{path} is not an IDX file: bad magic number {raw[:4].hex() or '<empty>'}")
    dtype, ndim = np.dtype(_IDX_DTYPES[raw[2]]), raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise HvdtrainError(f"{path}: truncated IDX header ({len(raw)} bytes, {ndim} dimensions)")
    shape = tuple(int(d) for d in np.frombuffer(raw, ">u4", ndim, 4))
    expected = header + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) != expected:
        raise HvdtrainError(
            f"{path}: IDX header says shape {shape} ({expected} bytes) but the file has {len(raw)} bytes"
            f" ({'truncated' if len(raw) < expected else 'trailing data'})")
    return np.frombuffer(raw, dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def _find_idx(data_dir: str, stem: str) -> str:
    for candidate in (stem, stem + ".gz"):
        path = os.path.join(data_dir, candidate)
        if os.path.isfile(path):
            return path
    raise HvdtrainError(f"{data_dir}: missing {stem}[.gz] (an MNIST-family IDX directory needs "
                        f"{', '.join(_IDX_FILES.values())})")


def load_idx_dir(data_dir: str) -> Dataset:
    """Load an MNIST-family directory (MNIST, Fashion-MNIST, KMNIST...) of four IDX files.

    Args:
        data_dir: directory holding ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
            ``t10k-images-idx3-ubyte`` and ``t10k-labels-idx1-ubyte``, each optionally ``.gz``.

    Returns:
        A :class:`Dataset` with uint8 images of shape ``(n, H, W, 1)``.

    Raises:
        HvdtrainError: for a missing directory or file, a corrupt file, or inconsistent contents
            (see :func:`validate`).
    """
    if os.path.isfile(data_dir):
        raise HvdtrainError(f"--data-dir {data_dir} is a file; --dataset idx (the default) reads a directory of IDX "
                            f"files (--dataset npz reads one .npz file)")
    if not os.path.isdir(data_dir):
        raise HvdtrainError(f"data directory {data_dir} does not exist (--data-dir)")
    arrays = {key: read_idx(_find_idx(data_dir, stem)) for key, stem in _IDX_FILES.items()}
    for key in ("x_train", "x_test"):
        if arrays[key].ndim != 3:
            raise HvdtrainError(f"{_find_idx(data_dir, _IDX_FILES[key])}: images must have 3 dimensions "
                                f"(count, rows, columns), got shape {arrays[key].shape}")
        arrays[key] = arrays[key][..., None]
    return validate(name=f"idx:{data_dir}", **arrays)


# ---- NPZ -----------------------------------------------------------------------------------------
def load_npz(path: str, labels: Optional[str] = CLASSES) -> Dataset:
    """Load a ``keras.datasets``-layout NPZ file: ``x_train, y_train, x_test, y_test``.

    Args:
        path: ``.npz`` file. Images ``(n, H, W)`` or ``(n, H, W, C)``, uint8 or floating point;
            class labels ``(n,)`` or ``(n, 1)`` (or ``(n, H', W')``, one per pixel), integer;
            targets ``(n, ...)``, numeric.
        labels: ``"classes"``, ``"targets"`` or None, as the loss takes them (:func:`validate`).

    Returns:
        A validated :class:`Dataset` (images given a channel axis if they had none).

    Raises:
        HvdtrainError: for a missing or unreadable file, missing keys, object arrays (never
            unpickled), wrong dtypes or shapes (see :func:`validate`).
    """
    if os.path.isdir(path):
        raise HvdtrainError(f"--data-dir {path} is a directory; --dataset npz reads one .npz file (--dataset idx "
                            f"reads a directory)")
    if not os.path.isfile(path):
        raise HvdtrainError(f"NPZ file {path} does not exist (--data-dir)")
    if not zipfile.is_zipfile(path):
        raise HvdtrainError(f"cannot read NPZ file {path}: not a zip archive (np.savez writes one)")
    arrays = {}
    try:
        with np.load(path, allow_pickle=False) as npz:
            missing = [k for k in _IDX_FILES if k not in npz.files]
            if missing:
                raise HvdtrainError(f"{path}: missing key(s) {missing}; an NPZ dataset needs "
                                    f"{list(_IDX_FILES)}, found {npz.files}")
            for key in _IDX_FILES:
                arrays[key] = npz[key]
    except ValueError as e:
        if "allow_pickle" in str(e):  # object arrays refuse to load without pickle
            raise HvdtrainError(f"{path}: cannot load without unpickling ({e}); store plain numeric arrays") from None
        raise HvdtrainError(f"cannot read NPZ file {path}: {e}") from None  # a damaged .npy header, say
    except (OSError, zipfile.BadZipFile, EOFError, zlib.error) as e:
        raise HvdtrainError(f"cannot read NPZ file {path}: {type(e).__name__}: {e}") from None
    for key in ("x_train", "x_test"):
        if arrays[key].ndim == 3:
            arrays[key] = arrays[key][..., None]
    labels = label_kind(arrays["y_train"], labels)
    for key in ("y_train", "y_test"):
        if labels == CLASSES and arrays[key].ndim == 2 and arrays[key].shape[1] == 1:
            arrays[key] = arrays[key][:, 0]
    return validate(name=f"npz:{path}", labels=labels, **arrays)


# ---- synthetic -------------------------------------------------------------------------------------
def make_synthetic(num_train: int = 6000, num_test: int = 1000, image_shape=(28, 28, 1),
                   num_classes: int = 10, seed: int = 0) -> Dataset:
    """A learnable synthetic dataset: random uint8 images labelled by a fixed random linear teacher.

    The same ``seed`` gives the same data on every rank and every run, so no file is needed and
    accuracy well above chance shows that training works.

    Args:
        num_train, num_test: example counts.
        image_shape: ``(H, W, C)``.
        num_classes: label count.
        seed: generator seed.

    Returns:
        A :class:`Dataset` with uint8 images.
    """
    rng = np.random.default_rng(seed)
    n = num_train + num_test
    x = rng.integers(0, 256, size=(n, *image_shape), dtype=np.uint8)
    teacher = rng.standard_normal((int(np.prod(image_shape)), num_classes)).astype(np.float32)
    features = (x.reshape(n, -1).astype(np.float32) / 255.0 - 0.5)
    y = np.argmax(features @ teacher, axis=1).astype(np.int32)
    return validate(x[:num_train], y[:num_train], x[num_train:], y[num_train:],
                    name=f"synthetic{tuple(image_shape)}", num_classes=num_classes)


# ---- validation ----------------------------------------------------------------------------------
def label_kind(y: np.ndarray, labels: Optional[str]) -> str:
    """``labels``, or where it is None (a loss that takes either), what ``y`` holds: integer labels
    are ``"classes"``, any other ``"targets"``."""
    return labels or (CLASSES if np.issubdtype(y.dtype, np.integer) else TARGETS)


def validate(x_train, y_train, x_test, y_test, name: str, num_classes: int = 0,
             labels: Optional[str] = CLASSES) -> Dataset:
    """Check shapes, dtypes, counts and label range, and return a :class:`Dataset`.

    Args:
        x_train, x_test: images ``(n, H, W, C)``, uint8 or floating point.
        y_train, y_test: labels ``(n, ...)``, the same shape per example in both splits.
        name: for messages.
        num_classes: class count; 0 infers ``max(label) + 1`` over both splits (classes only).
        labels: ``"classes"``: integer class indices (stored int32); ``"targets"``: numbers,
            stored float32, ``(n,)`` as ``(n, 1)`` (``num_classes`` becomes the size of their last axis);
            None: by ``y_train``'s dtype (:func:`label_kind`).

    Raises:
        HvdtrainError: naming the array and the problem (dtype, shape, count mismatch, empty,
            label out of range, a class with no training example when ``num_classes`` is
            inferred, non-finite pixels or targets).
    """
    labels = label_kind(y_train, labels)
    for key, x in (("x_train", x_train), ("x_test", x_test)):
        if x.dtype != np.uint8 and not np.issubdtype(x.dtype, np.floating):
            raise HvdtrainError(f"{name}: {key} must be uint8 or floating point, got dtype {x.dtype}")
        if x.ndim != 4:
            raise HvdtrainError(f"{name}: {key} must have shape (n, H, W[, C]), got {x.shape}")
    # Floating-point images are trained on as float32: checked after the cast, where a float64
    # value beyond float32's range has become infinite.
    with np.errstate(over="ignore"):  # an overflow becomes inf, refused just below
        x_train, x_test = (x if x.dtype == np.uint8 else x.astype(np.float32) for x in (x_train, x_test))
    for key, x in (("x_train", x_train), ("x_test", x_test)):
        if x.dtype == np.float32:
            check_finite(name, key, x, "example")
    if x_train.shape[1:] != x_test.shape[1:]:
        raise HvdtrainError(f"{name}: train images {x_train.shape[1:]} and test images {x_test.shape[1:]} differ in shape")
    for key, y, x in (("y_train", y_train, x_train), ("y_test", y_test, x_test)):
        if labels == CLASSES and not np.issubdtype(y.dtype, np.integer):
            raise HvdtrainError(f"{name}: {key} must be integer class labels, got dtype {y.dtype}"
                                + not_integer_labels(key, y))
        if labels == TARGETS and not (np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.floating)):
            raise HvdtrainError(f"{name}: {key} must be numeric targets, got dtype {y.dtype}")
        if y.ndim < 1:
            raise HvdtrainError(f"{name}: {key} must have shape (n, ...), got {y.shape}")
        if len(y) != len(x):
            raise HvdtrainError(f"{name}: {len(x)} images but {len(y)} labels in {key}")
    if y_train.shape[1:] != y_test.shape[1:]:
        raise HvdtrainError(f"{name}: train labels {y_train.shape[1:]} and test labels {y_test.shape[1:]} differ in "
                            f"shape")
    if labels == CLASSES:
        num_classes = check_labels(name, y_train, y_test, num_classes, positions=True)
        y_train, y_test = y_train.astype(np.int32), y_test.astype(np.int32)
    else:
        with np.errstate(over="ignore"):
            y_train, y_test = y_train.astype(np.float32), y_test.astype(np.float32)
        if y_train.ndim == 1:  # one number per image: the model's (batch, 1) outputs
            y_train, y_test = y_train[:, None], y_test[:, None]
        if len(y_train) == 0 or len(y_test) == 0:
            raise HvdtrainError(f"{name}: empty dataset ({len(y_train)} training, {len(y_test)} test examples)")
        for key, y in (("y_train", y_train), ("y_test", y_test)):
            check_finite(name, key, y, "label")
        num_classes = y_train.shape[-1] if y_train.ndim > 1 else 1
    return Dataset(
        x_train=np.ascontiguousarray(x_train),
        y_train=np.ascontiguousarray(y_train),
        x_test=np.ascontiguousarray(x_test),
        y_test=np.ascontiguousarray(y_test),
        num_classes=num_classes,
        name=name,
        labels=labels,
    )


def load_dataset(kind: str, data_dir: str, seed: int = 0, labels: Optional[str] = CLASSES) -> Dataset:
    """Load the dataset named by ``--dataset`` (``idx``, ``npz`` or ``synthetic``) from ``--data-dir``,
    its labels read as ``labels`` (``"classes"``, ``"targets"`` or None, as the loss takes them).

    Raises:
        HvdtrainError: for an unknown kind, or whatever the loader raises.
    """
    if kind == "npz":
        return load_npz(data_dir, labels)
    if kind not in ("idx", "synthetic"):
        raise HvdtrainError(f"unknown dataset {kind!r}; choose idx, npz or synthetic")
    dataset = load_idx_dir(data_dir) if kind == "idx" else make_synthetic(seed=seed)
    if labels in (CLASSES, None):
        return dataset
    # Class indices as targets (a regression onto them, say).
    return validate(dataset.x_train, dataset.y_train, dataset.x_test, dataset.y_test, dataset.name, labels=labels)
