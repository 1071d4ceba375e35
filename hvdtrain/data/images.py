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


# No antialiasing, as TensorFlow Model Garden's ImageNet input: a crop shrinks by at most ~2.2x
# to 224 px, where benchmarks/imagenet_input.py measures the error it adds as small against the
# third of the input pipeline's throughput that antialiasing costs.
ANTIALIAS = False


def resize(image: tf.Tensor, size: int) -> tf.Tensor:
    """uint8 ``(H, W, C)`` -> uint8 ``(size, size, C)``, bilinear (rounded, not truncated)."""
    resized = tf.image.resize(image, [size, size], antialias=ANTIALIAS)
    return tf.cast(tf.clip_by_value(tf.round(resized), 0.0, 255.0), tf.uint8)


def crop_window(shape: tf.Tensor, channels: int, random: bool, seed: Optional[tf.Tensor]) -> tf.Tensor:
    """``[top, left, height, width]`` (int32 ``(4,)``) of a view's crop in an image of ``shape``
    (int32 ``(H, W, ...)``).

    Args:
        shape: the image's shape; only its height and width are read.
        channels: the image's channels (the sampling op wants a full shape).
        random: random-resized-crop's box, of 8-100% of the area and aspect ratio 3/4-4/3 (the
            Inception recipe: Szegedy et al. 2015, "Going deeper with convolutions"), by the
            stateless sampling op given ``seed``; False: the central square of the shorter side.
        seed: int64 ``(2,)``, with ``random``.
    """
    height, width = shape[0], shape[1]
    if random:
        begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
            tf.stack([height, width, channels]), bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]), seed=seed,
            area_range=CROP_AREA, aspect_ratio_range=CROP_ASPECT_RATIO, min_object_covered=0.0,
            max_attempts=10, use_image_if_no_bounding_boxes=True)
        return tf.stack([begin[0], begin[1], size[0], size[1]])
    side = tf.minimum(height, width)
    return tf.stack([(height - side) // 2, (width - side) // 2, side, side])


def _cropped(image: tf.Tensor, window: tf.Tensor) -> tf.Tensor:
    top, left, height, width = tf.unstack(window)
    return image[top:top + height, left:left + width]


def _flipped(image: tf.Tensor, training: bool, augment: str, seed: Optional[tf.Tensor]) -> tf.Tensor:
    if training and augment in ("flip", "standard"):
        return tf.image.stateless_random_flip_left_right(image, seed=seed + 1)
    return image


def preprocess(image: tf.Tensor, training: bool, augment: str, image_size: int,
               stored_shape: Optional[Sequence[int]], seed: Optional[tf.Tensor]) -> tf.Tensor:
    """One decoded uint8 image -> the model's input view, uint8 ``(S, S, C)`` or the stored shape.

    Args:
        image: uint8 ``(H, W, C)``.
        training: training split (augmented) or evaluation (center crop only).
        augment: ``none``; ``flip`` (random left-right flip); ``standard`` (random-resized-crop,
            then flip; needs ``image_size``).
        image_size: side ``S`` of the square the model sees: the view's crop (random-resized-crop
            in training with ``standard``, else the central square) resized to it; 0 keeps the
            stored size, which every image must then share (``stored_shape``).
        stored_shape: ``(H, W, C)`` every image must have when ``image_size`` is 0.
        seed: int64 ``(2,)`` stateless seed of this example in this epoch (None where nothing is
            random: evaluation, or ``augment="none"``).

    Raises (when the pipeline runs):
        tf.errors.InvalidArgumentError: for an image of another shape than ``stored_shape``.
    """
    if image_size:
        random = training and augment == "standard"
        image = resize(_cropped(image, crop_window(tf.shape(image), image.shape[-1], random, seed)), image_size)
    else:
        image = tf.ensure_shape(image, stored_shape)
    return _flipped(image, training, augment, seed)


def is_jpeg(encoded: tf.Tensor) -> tf.Tensor:
    """Whether ``encoded`` (a scalar string) starts with JPEG's SOI marker and a marker byte."""
    return tf.equal(tf.strings.substr(encoded, 0, 3), b"\xff\xd8\xff")


def decode_view(encoded: tf.Tensor, channels: int, training: bool, augment: str, image_size: int,
                stored_shape: Optional[Sequence[int]], seed: Optional[tf.Tensor]) -> tf.Tensor:
    """Encoded bytes -> the model's input view: :func:`decode` then :func:`preprocess`, but a
    JPEG's crop is decoded alone (``tf.image.decode_and_crop_jpeg``, as TensorFlow Model Garden's
    ImageNet input): the inverse DCT, upsampling and color conversion run on the crop's blocks
    alone, and rows below it are not read. The window is sampled from the JPEG's header
    (``tf.image.extract_jpeg_shape``) by the same op and seed as from the decoded image's shape,
    so the box is the same. The pixels are the whole decode's but in the crop's rightmost column
    of a chroma-subsampled JPEG, whose chroma libjpeg upsamples from the crop's edge (a few
    levels). PNG, BMP and GIF are decoded whole, then cropped. Arguments as :func:`preprocess`.

    Raises (when the pipeline runs):
        tf.errors.InvalidArgumentError: for bytes that are no image, or an image of another shape
            than ``stored_shape`` (``image_size`` 0).
    """
    if not image_size:  # the stored size: nothing to crop
        return preprocess(decode(encoded, channels), training, augment, image_size, stored_shape, seed)
    random = training and augment == "standard"

    def jpeg():
        window = crop_window(tf.image.extract_jpeg_shape(encoded), channels, random, seed)
        return tf.image.decode_and_crop_jpeg(encoded, window, channels=channels)

    def other():
        image = decode(encoded, channels)
        return _cropped(image, crop_window(tf.shape(image), channels, random, seed))

    crop = tf.cond(is_jpeg(encoded), jpeg, other)
    crop.set_shape([None, None, channels])
    return _flipped(resize(crop, image_size), training, augment, seed)


def example_seed(seed: int, epoch: int, key: tf.Tensor) -> tf.Tensor:
    """The stateless seed (int64 ``(2,)``) of the example with unique ``key`` in an epoch."""
    return tf.stack([tf.constant(seed, tf.int64), tf.constant(epoch, tf.int64) * (1 << 40) + tf.cast(key, tf.int64)])
