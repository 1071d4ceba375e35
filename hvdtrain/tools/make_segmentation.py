"""A segmentation dataset made from an MNIST-family IDX directory: a garment class per pixel.

    python -m hvdtrain.tools.make_segmentation --out fashion-seg.npz [--train 60000 --test 10000]

writes a ``keras.datasets``-style NPZ (``--dataset npz``) of the images ``(n, 28, 28)`` uint8
and label maps ``(n, 28, 28)`` uint8: each pixel brighter than ``--threshold`` is the garment,
labelled with the image's class + 1, every other pixel is background, 0 (K = 11 classes). A
model must find the garment's outline and name it; the class of a pixel depends on the whole
image, so the task needs context as a real segmentation task does. The NPZ appears whole (written
under a temporary name, then renamed).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from hvdtrain.config import DEFAULT_DATA_DIR
from hvdtrain.data.in_memory import load_idx_dir
from hvdtrain.errors import HvdtrainError
from hvdtrain.console import say


def label_maps(images: np.ndarray, classes: np.ndarray, threshold: int) -> np.ndarray:
    """``(n, H, W)`` uint8 label maps of images ``(n, H, W, 1)`` uint8 and their classes ``(n,)``:
    ``class + 1`` where a pixel is brighter than ``threshold``, else 0."""
    return np.where(images[..., 0] > threshold, classes[:, None, None] + 1, 0).astype(np.uint8)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="MNIST-family IDX directory")
    p.add_argument("--out", required=True, help="the .npz file to write")
    p.add_argument("--train", type=int, default=0, help="the first N training images (0: all)")
    p.add_argument("--test", type=int, default=0, help="the first N test images (0: all)")
    p.add_argument("--threshold", type=int, default=32, help="pixels above this (0-255) are the garment")
    a = p.parse_args(argv)
    try:
        if not 0 <= a.threshold < 255:
            raise HvdtrainError(f"--threshold must be in [0, 255), got {a.threshold}")
        if a.train < 0 or a.test < 0:
            raise HvdtrainError(f"--train and --test must be >= 0, got {a.train} and {a.test}")
        data = load_idx_dir(a.data_dir)
        train, test = slice(a.train or None), slice(a.test or None)
        arrays = {"x_train": data.x_train[train, ..., 0], "x_test": data.x_test[test, ..., 0],
                  "y_train": label_maps(data.x_train[train], data.y_train[train], a.threshold),
                  "y_test": label_maps(data.x_test[test], data.y_test[test], a.threshold)}
        temporary = os.path.join(os.path.dirname(os.path.abspath(a.out)), f".{os.path.basename(a.out)}.tmp.npz")
        try:
            np.savez(temporary, **arrays)
            os.replace(temporary, a.out)
        except OSError as e:
            raise HvdtrainError(f"cannot write {a.out}: {e.strerror or e}") from None
        finally:
            if os.path.exists(temporary):
                os.remove(temporary)
    except HvdtrainError as e:
        say(f"make_segmentation: error: {e}", sys.stderr)
        return 2
    say(f"{a.out}: {len(arrays['x_train']):,} train / {len(arrays['x_test']):,} test images with 28x28 label maps "
        f"of 11 classes (0: background)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
