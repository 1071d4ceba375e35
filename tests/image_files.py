"""Image folders and TFRecord shards made at test time from Debian's Fashion-MNIST copy (no download)."""
from __future__ import annotations

import os

import numpy as np


def write_image_folder(root, x_train, y_train, x_test, y_test, fmt: str = "jpg", quality: int = 100) -> str:
    """Write ``root/train/<class>/<index>.<fmt>`` and ``root/test/...``: uint8 images ``(n, H, W, C)``.

    Classes are named ``class<k>`` so that sorted names keep label ``k``; file names are the
    example's index, zero-padded, so that the folder's order is the arrays' order within a class.
    Returns ``root``.
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
    """The order in which ``--dataset folder`` lists the examples written by :func:`write_image_folder`."""
    return np.lexsort((np.arange(len(y)), y))
