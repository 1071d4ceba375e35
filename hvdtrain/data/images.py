"""Image decoding, resizing and augmentation as tf.data map functions (graph ops, never Python
per example).

Every function maps one encoded or decoded image to a uint8 ``(H, W, C)`` tensor, so that batches
cross to the device as bytes and :func:`hvdtrain.step.to_model_input` scales them there. Random
choices are stateless, seeded by ``(seed, epoch, example)``: a run, and a resumed run, augments
every example alike.
"""
from __future__ import annotations

from typing import Optional, Sequence

import tensorflow as tf

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif")
# Random-resized-crop's ranges (Szegedy et al. 2015, "Going deeper with convolutions", as
# torchvision's RandomResizedCrop and Keras' RandomCrop recipes use them).
CROP_AREA = (0.08, 1.0)
CROP_ASPECT_RATIO = (3 / 4, 4 / 3)


def decode(encoded: tf.Tensor, channels: int) -> tf.Tensor:
    """JPEG, PNG, BMP or GIF (first frame) bytes -> uint8 ``(H, W, channels)``.

    Raises (when the pipeline runs):
        tf.errors.InvalidArgumentError: for bytes that are no image of these formats.
    """
    image = tf.io.decode_image(encoded, channels=channels, expand_animations=False)
    image.set_shape([None, None, channels])
    return image


def _to_uint8(image: tf.Tensor) -> tf.Tensor:
    return tf.cast(tf.clip_by_value(tf.round(image), 0.0, 255.0), tf.uint8)


def center_crop(image: tf.Tensor, size: int) -> tf.Tensor:
    """The central square of the shorter side, resized (bilinear) to ``(size, size)``: evaluation's view."""
    shape = tf.shape(image)
    side = tf.minimum(shape[0], shape[1])
    top, left = (shape[0] - side) // 2, (shape[1] - side) // 2
    square = image[top:top + side, left:left + side]
    return _to_uint8(tf.image.resize(square, [size, size], antialias=True))


def random_resized_crop(image: tf.Tensor, size: int, seed: tf.Tensor) -> tf.Tensor:
    """A random crop of 8-100% of the area and aspect ratio 3/4-4/3, resized to ``(size, size)``
    (the Inception recipe; Szegedy et al. 2015). ``seed``: int64 ``(2,)``."""
    begin, crop_size, _ = tf.image.stateless_sample_distorted_bounding_box(
        tf.shape(image), bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]), seed=seed,
        area_range=CROP_AREA, aspect_ratio_range=CROP_ASPECT_RATIO, min_object_covered=0.0,
        max_attempts=10, use_image_if_no_bounding_boxes=True)
    crop = tf.slice(image, begin, crop_size)
    return _to_uint8(tf.image.resize(crop, [size, size], antialias=True))


def preprocess(image: tf.Tensor, training: bool, augment: str, image_size: int,
               stored_shape: Optional[Sequence[int]], seed: Optional[tf.Tensor]) -> tf.Tensor:
    """One decoded uint8 image -> the model's input view, uint8 ``(S, S, C)`` or the stored shape.

    Args:
        image: uint8 ``(H, W, C)``.
        training: training split (augmented) or evaluation (center crop only).
        augment: ``none``; ``flip`` (random left-right flip); ``standard`` (random-resized-crop,
            then flip; needs ``image_size``).
        image_size: side ``S`` of the square the model sees; 0 keeps the stored size, which every
            image must then share (``stored_shape``).
        stored_shape: ``(H, W, C)`` every image must have when ``image_size`` is 0.
        seed: int64 ``(2,)`` stateless seed of this example in this epoch (None where nothing is
            random: evaluation, or ``augment="none"``).

    Raises (when the pipeline runs):
        tf.errors.InvalidArgumentError: for an image of another shape than ``stored_shape``.
    """
    if image_size:
        if training and augment == "standard":
            image = random_resized_crop(image, image_size, seed)
        else:
            image = center_crop(image, image_size)
    else:
        image = tf.ensure_shape(image, stored_shape)
    if training and augment in ("flip", "standard"):
        image = tf.image.stateless_random_flip_left_right(image, seed=seed + 1)
    return image


def example_seed(seed: int, epoch: int, key: tf.Tensor) -> tf.Tensor:
    """The stateless seed (int64 ``(2,)``) of the example with unique ``key`` in an epoch."""
    return tf.stack([tf.constant(seed, tf.int64), tf.constant(epoch, tf.int64) * (1 << 40) + tf.cast(key, tf.int64)])
