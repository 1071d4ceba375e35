"""ImageNet-like JPEGs made here (no download): ImageNet's sizes and compression, natural statistics.

ILSVRC-2012's training JPEGs are mostly 500 px on the long side (500x375, 375x500, 500x333, ...,
shorter ones down to ~300 px), quality ~90 with 4:2:0 chroma, about 110 KB each. Content is noise
shaped like a photograph's spectrum: natural images' amplitude falls as 1/f with spatial frequency
f (Field 1987, "Relations between the statistics of natural images and the response properties of
cortical cells"), with correlated color channels. That gives JPEGs of a photograph's size and
decoding work; white noise would be far larger and slower to decode, flat color far smaller.
"""
from __future__ import annotations

import os
from typing import Tuple

import numpy as np

# (height, width) shapes and their shares, ILSVRC-2012's most common ones.
SHAPES = ((375, 500), (500, 375), (333, 500), (500, 333), (500, 500), (400, 300), (300, 400))
SHARES = (0.45, 0.12, 0.15, 0.05, 0.08, 0.08, 0.07)
QUALITY = 90


def natural_image(height: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 ``(height, width, 3)``: random phases, amplitude 1/f, colors mixed across channels."""
    fy = np.fft.fftfreq(height)[:, None]
    fx = np.fft.rfftfreq(width)[None, :]
    f = np.hypot(fx, fy)
    f[0, 0] = 1.0
    planes = [np.fft.irfft2(np.exp(2j * np.pi * rng.random(f.shape)) / f, s=(height, width)) for _ in range(3)]
    mix = np.eye(3) + 0.3 * rng.normal(size=(3, 3))
    image = np.stack(planes, -1) @ mix.T
    image = 128 + 50 * (image - image.mean()) / image.std() + rng.normal(0, 1.5, size=image.shape)  # sensor noise
    return np.clip(image, 0, 255).astype(np.uint8)


def write_folder(root: str, train: int, test: int, classes: int = 10, seed: int = 0) -> Tuple[str, float]:
    """``root/train/<class>/*.JPEG`` and ``root/test/...``; returns ``(root, mean KB per file)``."""
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    sizes = []
    for split, count in (("train", train), ("test", test)):
        for i in range(count):
            height, width = SHAPES[rng.choice(len(SHAPES), p=SHARES)]
            folder = os.path.join(root, split, f"n{i % classes:08d}")
            os.makedirs(folder, exist_ok=True)
            encoded = tf.io.encode_jpeg(natural_image(height, width, rng), quality=QUALITY).numpy()
            with open(os.path.join(folder, f"{split}_{i:06d}.JPEG"), "wb") as f:
                f.write(encoded)
            sizes.append(len(encoded))
    return root, float(np.mean(sizes)) / 1024
