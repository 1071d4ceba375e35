"""An image folder (``--dataset folder``) made from an MNIST-family IDX directory.

    python -m hvdtrain.tools.make_image_folder --out fashion-folder/ [--format png --train 60000 --test 10000]

writes ``<out>/train/class<k>/<index>.<format>`` and ``<out>/test/...`` (JPEG or PNG) of the IDX
directory's images, so that ``--dataset folder`` (and ``make_tfrecords``) can be tried on real data
with no download. Class folders are named ``class<k>`` (zero-padded) so that their sorted order
keeps label ``k``; file names are the example's index, so that a class's files list in the
arrays' order (:func:`folder_order`).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from hvdtrain.config import DEFAULT_DATA_DIR
from hvdtrain.console import say
from hvdtrain.data.in_memory import load_idx_dir
from hvdtrain.errors import HvdtrainError


def write_image_folder(root, x_train, y_train, x_test, y_test, fmt: str = "jpg", quality: int = 100) -> str:
    """Write ``root/train/class<k>/<index>.<fmt>`` and ``root/test/...``.

    Args:
        root: the folder to write (created).
        x_train, x_test: uint8 images ``(n, H, W, C)``, C 1 or 3.
        y_train, y_test: int class indices ``(n,)``.
        fmt: ``"jpg"`` (4:4:4 chroma, ``quality``) or ``"png"`` (lossless).

    Returns:
        ``root`` as a string.
    """
    import tensorflow as tf

    for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
        for k in np.unique(y):
            os.makedirs(os.path.join(root, split, f"class{k:02d}"), exist_ok=True)
        for i, (image, label) in enumerate(zip(x, y)):
            encoded = (tf.io.encode_jpeg(image, quality=quality, chroma_downsampling=False) if fmt == "jpg"
                       else tf.io.encode_png(image))
            with open(os.path.join(root, split, f"class{label:02d}", f"{i:06d}.{fmt}"), "wb") as f:
                f.write(encoded.numpy())
    return str(root)


def folder_order(y: np.ndarray) -> np.ndarray:
    """The order in which ``--dataset folder`` lists the examples :func:`write_image_folder` wrote,
    as indices into the arrays: by class, then by index."""
    return np.lexsort((np.arange(len(y)), y))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hvdtrain.tools.make_image_folder", description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="the IDX directory (default: Debian's Fashion-MNIST)")
    p.add_argument("--out", required=True, help="the image folder to write (must not exist)")
    p.add_argument("--format", choices=("jpg", "png"), default="png", help="image format (default: png, lossless)")
    p.add_argument("--train", type=int, default=0, help="the first N training images only (0: all)")
    p.add_argument("--test", type=int, default=0, help="the first N test images only (0: all)")
    a = p.parse_args(argv)
    try:
        if os.path.exists(a.out):
            raise HvdtrainError(f"--out {a.out} exists: give a new folder")
        data = load_idx_dir(a.data_dir)
        n, m = a.train or len(data.y_train), a.test or len(data.y_test)
        write_image_folder(a.out, data.x_train[:n], data.y_train[:n], data.x_test[:m], data.y_test[:m], a.format)
    except HvdtrainError as e:
        say(f"make_image_folder: error: {e}", sys.stderr)
        return 2
    say(f"wrote {n:,} training and {m:,} test images to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
