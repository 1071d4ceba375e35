"""Image views: a JPEG's crop decoded alone (decode_view) is the decoded image's crop, pixel for
pixel, with the same crop box distribution as before the fused decode; other formats alike."""
import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.data import images

SIZE = 24


def photo(height, width, seed=0):
    """uint8 ``(height, width, 3)``: smooth color fields plus texture, so that crops and chroma
    subsampling show (a flat image would hide a misplaced box)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    base = np.stack([np.sin(7 * x + 3 * y), np.cos(5 * y - 2 * x), np.sin(11 * x * y)], -1)
    return np.clip(128 + 90 * base + rng.normal(0, 12, (height, width, 3)), 0, 255).astype(np.uint8)


def encoded(fmt, height=75, width=113, seed=0):
    image = photo(height, width, seed)
    return tf.io.encode_jpeg(image, quality=90) if fmt == "jpeg" else tf.io.encode_png(image)


def todays_box(shape, seed):
    """The random-resized-crop box sampled from the decoded image, as hvdtrain did it before the
    fused decode: ``(top, left, height, width)``."""
    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        shape, bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]), seed=seed, area_range=(0.08, 1.0),
        aspect_ratio_range=(3 / 4, 4 / 3), min_object_covered=0.0, max_attempts=10,
        use_image_if_no_bounding_boxes=True)
    return (int(begin[0]), int(begin[1]), int(size[0]), int(size[1]))


VIEWS = [(True, "standard"), (True, "flip"), (False, "standard"), (True, "none")]


def views(data, training, augment, i):
    seed = images.example_seed(3, i, tf.constant(i))
    fused = images.decode_view(data, 3, training, augment, SIZE, None, seed)
    plain = images.preprocess(images.decode(data, 3), training, augment, SIZE, None, seed)
    assert fused.dtype == tf.uint8 and fused.shape == (SIZE, SIZE, 3)
    return fused.numpy().astype(int), plain.numpy().astype(int)


@pytest.mark.parametrize("training,augment", VIEWS)
@pytest.mark.parametrize("fmt", ["png", "jpeg 4:4:4"])
def test_decode_view_equals_decode_then_preprocess(fmt, training, augment):
    for i in range(12):  # odd sizes: crops off the JPEG's 8-px block grid
        image = photo(60 + 7 * i, 131 - 5 * i, seed=i)
        data = tf.io.encode_png(image) if fmt == "png" else tf.io.encode_jpeg(image, quality=90,
                                                                               chroma_downsampling=False)
        fused, plain = views(data, training, augment, i)
        np.testing.assert_array_equal(fused, plain)


@pytest.mark.parametrize("training,augment", VIEWS)
def test_subsampled_jpeg_differs_only_in_the_crops_last_column(training, augment):
    """With 4:2:0 chroma (ImageNet's JPEGs), libjpeg upsamples the chroma of a cropped decode's
    rightmost column from the crop's edge, not from its neighbor outside: that column moves by a
    few levels, every other pixel is the whole decode's."""
    for i in range(12):
        data = encoded("jpeg", 60 + 7 * i, 131 - 5 * i, seed=i)
        seed = images.example_seed(3, i, tf.constant(i))
        window = images.crop_window(tf.image.extract_jpeg_shape(data), 3, training and augment == "standard", seed)
        top, left, height, width = window.numpy()
        crop = tf.image.decode_and_crop_jpeg(data, window, channels=3).numpy().astype(int)
        whole = images.decode(data, 3).numpy()[top:top + height, left:left + width].astype(int)
        np.testing.assert_array_equal(crop[:, :-1], whole[:, :-1])
        assert np.abs(crop[:, -1] - whole[:, -1]).max() <= 8
        fused, plain = views(data, training, augment, i)
        assert np.abs(fused - plain).max() <= 8 and np.abs(fused - plain).mean() < 0.1


def test_jpeg_crop_box_distribution_is_unchanged():
    """The box sampled from the JPEG header is the box sampled from the decoded image, seed by seed,
    so the areas and aspect ratios are today's: 8-100% of the image, 3/4-4/3."""
    data = encoded("jpeg", 375, 500)
    shape = tf.image.extract_jpeg_shape(data)
    decoded_shape = tf.shape(images.decode(data, 3))
    boxes = []
    for i in range(400):
        seed = images.example_seed(0, 0, tf.constant(i))
        box = tuple(int(v) for v in images.crop_window(shape, 3, True, seed))
        assert box == todays_box(decoded_shape, seed)
        boxes.append(box)
    boxes = np.array(boxes, np.float64)
    area = boxes[:, 2] * boxes[:, 3] / (375 * 500)
    ratio = boxes[:, 3] / boxes[:, 2]
    assert area.min() >= 0.07 and area.max() <= 1.0 and 0.3 < np.median(area) < 0.6
    assert ratio.min() > 0.7 and ratio.max() < 1.4
    assert len(set(map(tuple, boxes))) > 390  # a random box per example, not a few


def test_center_crop_is_the_central_square():
    assert images.crop_window(tf.constant([375, 500, 3]), 3, False, None).numpy().tolist() == [0, 62, 375, 375]
    assert images.crop_window(tf.constant([501, 300, 3]), 3, False, None).numpy().tolist() == [100, 0, 300, 300]


def test_views_are_a_function_of_seed_epoch_and_example():
    data = encoded("jpeg")

    def view(epoch, key):
        return images.decode_view(data, 3, True, "standard", SIZE, None,
                                  images.example_seed(7, epoch, tf.constant(key))).numpy()

    np.testing.assert_array_equal(view(1, 5), view(1, 5))
    assert not np.array_equal(view(1, 5), view(2, 5)) and not np.array_equal(view(1, 5), view(1, 6))


def test_stored_size_keeps_the_image_and_checks_its_shape():
    data = encoded("jpeg", 20, 30)
    kept = images.decode_view(data, 3, False, "none", 0, (20, 30, 3), None)
    np.testing.assert_array_equal(kept.numpy(), images.decode(data, 3).numpy())
    with pytest.raises(tf.errors.InvalidArgumentError):
        images.decode_view(data, 3, False, "none", 0, (28, 28, 3), None)


def test_bytes_that_are_no_image_are_an_error():
    with pytest.raises(tf.errors.InvalidArgumentError):
        images.decode_view(tf.constant(b"\xff\xd8\xff not really a jpeg"), 3, True, "standard", SIZE, None,
                           images.example_seed(0, 0, tf.constant(0)))
    with pytest.raises(tf.errors.InvalidArgumentError):
        images.decode_view(tf.constant(b"plain text"), 3, False, "none", SIZE, None, None)


def test_grey_jpeg_to_three_channels():
    grey = tf.io.encode_jpeg(photo(40, 50)[..., :1], quality=90)
    fused = images.decode_view(grey, 3, False, "none", SIZE, None, None)
    plain = images.preprocess(images.decode(grey, 3), False, "none", SIZE, None, None)
    np.testing.assert_array_equal(fused.numpy(), plain.numpy())


def test_image_views_of_a_decoded_image():
    image = tf.constant(np.arange(6 * 10 * 3, dtype=np.uint8).reshape(6, 10, 3))
    seed = tf.constant([1, 2], tf.int64)
    crops = [images.preprocess(image, True, "standard", 5, None, seed + i) for i in range(4)]
    assert all(c.shape == (5, 5, 3) and c.dtype == tf.uint8 for c in crops)
    assert len({c.numpy().tobytes() for c in crops}) > 1, "random crops differ by seed"
    assert np.array_equal(images.preprocess(image, True, "standard", 5, None, seed), crops[0]), "stateless"
    center = images.resize(image[:, 2:8], 5)
    assert np.array_equal(images.preprocess(image, False, "standard", 5, None, seed), center), \
        "evaluation is the central square, resized"
    kept = images.preprocess(image, True, "none", 0, (6, 10, 3), seed)
    assert np.array_equal(kept, image)
