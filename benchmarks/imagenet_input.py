"""Can hvdtrain's input pipeline feed a GPU at ImageNet size? Its img/s per core against TensorFlow
Model Garden's ImageNet input, side by side in one run.

    .venv/bin/python benchmarks/imagenet_input.py                       # 1,200 + 400 images, 3 rounds
    .venv/bin/python benchmarks/imagenet_input.py --train-images 300 --test-images 300 --rounds 1

Makes ImageNet-like JPEGs (:mod:`imagenet_like`: ImageNet's sizes and compression, a photograph's
spectrum) as an image folder and as TFRecord shards (``make_tfrecords``). Then, per round, in
alternating order, each a fresh process pinned to as many cores as threads:

- *hvdtrain*: ``python -m hvdtrain.tools.input_speed``, the pipeline a training run uses
  (folder and TFRecord; the training view, random-resized-crop to 224 and flip, and the
  evaluation view, the central square resized to 224), on 1 and 2 threads;
- *reference*: the same reads, crops and flips written here as Model Garden's
  ``official/vision/dataloaders/classification_input.py`` does them
  (``preprocess_ops.random_crop_image_v2`` / ``center_crop_image_v2``: the crop decoded alone by
  ``decode_and_crop_jpeg``; bilinear resize; mean/std normalization; float32 batches);
- *antialiasing*: hvdtrain's training view with ``antialias=True``, and the resize error (PSNR
  against a Lanczos-3 antialiased resize of the same crop) with and without it.

Prints img/s per variant (median over rounds), hvdtrain / reference per core, the 1 -> 2 thread
scaling of both (the reference's is what the machine allows), and how many cores feed one GPU at
``--target`` img/s. Tables only, no plot.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import common  # noqa: E402
import imagenet_like  # noqa: E402

IMAGE_SIZE = 224
CROP_PADDING = 32  # Model Garden's center crop: the central 224/256 of the shorter side
MEAN_RGB = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STDDEV_RGB = (0.229 * 255, 0.224 * 255, 0.225 * 255)


def reference_batches(kind: str, path: str, split: str, batch_size: int, threads: int):
    """Model Garden's ImageNet input (``classification_input.Parser``) over our files."""
    import glob

    import tensorflow as tf

    def train_view(encoded):
        shape = tf.image.extract_jpeg_shape(encoded)
        begin, size, _ = tf.image.sample_distorted_bounding_box(
            shape, tf.constant([0.0, 0.0, 1.0, 1.0], shape=[1, 1, 4]), min_object_covered=0.08,
            aspect_ratio_range=(3 / 4, 4 / 3), area_range=(0.08, 1.0), max_attempts=10,
            use_image_if_no_bounding_boxes=True)
        image = tf.image.decode_and_crop_jpeg(encoded, tf.stack([begin[0], begin[1], size[0], size[1]]), channels=3)
        return tf.image.random_flip_left_right(image)

    def eval_view(encoded):
        shape = tf.image.extract_jpeg_shape(encoded)
        side = tf.cast(IMAGE_SIZE / (IMAGE_SIZE + CROP_PADDING) * tf.cast(tf.minimum(shape[0], shape[1]), tf.float32),
                       tf.int32)
        top, left = (shape[0] - side + 1) // 2, (shape[1] - side + 1) // 2
        return tf.image.decode_and_crop_jpeg(encoded, tf.stack([top, left, side, side]), channels=3)

    def parse(encoded, label):
        image = (train_view if split == "train" else eval_view)(encoded)
        image = tf.image.resize(image, [IMAGE_SIZE, IMAGE_SIZE], method=tf.image.ResizeMethod.BILINEAR)
        image = (image - MEAN_RGB) / STDDEV_RGB
        return tf.image.convert_image_dtype(image, tf.float32), label

    if kind == "folder":
        files = sorted(glob.glob(os.path.join(path, split, "*", "*")))
        data = tf.data.Dataset.from_tensor_slices((files, tf.zeros(len(files), tf.int32)))
        data = data.map(lambda f, label: (tf.io.read_file(f), label))
    else:
        files = sorted(glob.glob(os.path.join(path, f"{split}-*")))
        features = {"image/encoded": tf.io.FixedLenFeature([], tf.string),
                    "image/class/label": tf.io.FixedLenFeature([], tf.int64)}
        data = tf.data.TFRecordDataset(files).map(
            lambda r: (lambda e: (e["image/encoded"], e["image/class/label"]))(tf.io.parse_single_example(r, features)))
    if split == "train":
        data = data.shuffle(10000, seed=0)
    data = data.map(parse, num_parallel_calls=threads).batch(batch_size).prefetch(2)
    options = tf.data.Options()
    options.threading.private_threadpool_size = threads
    options.autotune.enabled = False
    return data.with_options(options)


def reference_worker(kind: str, path: str, split: str, batch_size: int, threads: int) -> None:
    """Print the reference's img/s on ``threads`` cores (a fresh process: run with ``--reference``)."""
    from hvdtrain.tools import input_speed

    cores = input_speed.pin(threads)
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    count, seconds = input_speed.measure(reference_batches(kind, path, split, batch_size, threads), 0)
    print(f"{count / seconds:,.0f} img/s on {len(cores)} thread(s)")


def rate(args) -> float:
    """img/s printed by a fresh process running ``args`` (first line: ``<img/s> img/s on ...``)."""
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO, env=common.env_for_ranks())
    if out.returncode:
        raise SystemExit(out.stdout[-2000:] + out.stderr[-3000:])
    return float(out.stdout.split(" img/s")[0].split()[-1].replace(",", ""))


def hvdtrain_args(kind, path, split, batch_size, threads, antialias=False):
    flags = ["--dataset", kind, "--data-dir", path, "--image-size", str(IMAGE_SIZE), "--augment", "standard",
             "--split", split, "--threads", str(threads), "--batch-size", str(batch_size)]
    if not antialias:
        return ["-m", "hvdtrain.tools.input_speed", *flags]
    return ["-c", "import sys; import hvdtrain.data.images as images; images.ANTIALIAS = True; "
                  "from hvdtrain.tools import input_speed; sys.exit(input_speed.main(sys.argv[1:]))", *flags]


def resize_error(folder: str, count: int) -> dict:
    """Mean PSNR (dB) of bilinear resizes to 224, with and without antialiasing, against a Lanczos-3
    antialiased resize of the same crops: ``count`` training crops (hvdtrain's boxes) and center crops."""
    import glob

    import tensorflow as tf

    from hvdtrain.data import images

    files = sorted(glob.glob(os.path.join(folder, "train", "*", "*")))[:count]
    psnr = {}
    for view in ("train", "test"):
        for i, name in enumerate(files):
            encoded = tf.io.read_file(name)
            window = images.crop_window(tf.image.extract_jpeg_shape(encoded), 3, view == "train",
                                        tf.constant([0, i], tf.int64))
            crop = tf.cast(tf.image.decode_and_crop_jpeg(encoded, window, channels=3), tf.float32)
            truth = tf.image.resize(crop, [IMAGE_SIZE, IMAGE_SIZE], method="lanczos3", antialias=True)
            for antialias in (False, True):
                resized = tf.image.resize(crop, [IMAGE_SIZE, IMAGE_SIZE], antialias=antialias)
                error = float(tf.reduce_mean(tf.square(resized - truth)))
                psnr.setdefault((view, antialias), []).append(10 * np.log10(255.0 ** 2 / max(error, 1e-12)))
    return {key: float(np.mean(values)) for key, values in psnr.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--train-images", type=common.at_least(64), default=1200)
    p.add_argument("--test-images", type=common.at_least(64), default=400)
    p.add_argument("--rounds", type=common.at_least(1), default=3)
    p.add_argument("--batch-size", type=common.at_least(1), default=128)
    p.add_argument("--target", type=float, default=3000.0, help="img/s one GPU trains at (ResNet-50, bf16, H100)")
    p.add_argument("--reference", nargs=5, metavar=("KIND", "PATH", "SPLIT", "BATCH", "THREADS"),
                   help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.reference:
        kind, path, split, batch, threads = a.reference
        return reference_worker(kind, path, split, int(batch), int(threads))
    threads = sorted({1, min(2, len(os.sched_getaffinity(0)))})
    with tempfile.TemporaryDirectory() as tmp:
        began = time.perf_counter()
        folder, kb = imagenet_like.write_folder(os.path.join(tmp, "folder"), a.train_images, a.test_images)
        from hvdtrain.tools import make_tfrecords

        paths = {"folder": folder, "tfrecord": os.path.join(tmp, "records")}
        make_tfrecords.main(["--folder", folder, "--out", paths["tfrecord"], "--shards", "8"])
        print(f"data: {a.train_images:,} training and {a.test_images:,} test JPEGs, {kb:,.0f} KB each on average "
              f"(ImageNet's: ~110 KB), as a folder and as 8 TFRecord shards ({time.perf_counter() - began:.0f} s)")
        variants = {}
        for kind in paths:
            for split in ("train", "test"):
                for n in threads:
                    variants[("hvdtrain", kind, split, n)] = hvdtrain_args(kind, paths[kind], split, a.batch_size, n)
                    variants[("reference", kind, split, n)] = [
                        __file__, "--reference", kind, paths[kind], split, str(a.batch_size), str(n)]
        variants[("hvdtrain, antialias", "folder", "train", 1)] = hvdtrain_args(
            "folder", folder, "train", a.batch_size, 1, antialias=True)
        rates = {key: [] for key in variants}
        for r in range(a.rounds):
            for key in (list(variants) if r % 2 == 0 else list(reversed(variants))):
                rates[key].append(rate(variants[key]))
        median = {key: statistics.median(values) for key, values in rates.items()}

        def ratio(top, bottom):  # median over rounds of each round's own ratio
            return statistics.median(x / y for x, y in zip(rates[top], rates[bottom]))

        rows = []
        for kind in paths:
            for split in ("train", "test"):
                one = ("hvdtrain", kind, split, 1)
                row = [kind, "training (random-resized-crop, flip)" if split == "train" else "evaluation (center crop)",
                       f"{median[one]:,.0f}", f"{median[('reference', kind, split, 1)]:,.0f}",
                       f"{ratio(one, ('reference', kind, split, 1)):.2f}"]
                if len(threads) > 1:
                    two, reference = ("hvdtrain", kind, split, 2), ("reference", kind, split)
                    row += [f"{median[two]:,.0f}", f"{ratio(two, one) / 2:.2f}",
                            f"{ratio((*reference, 2), (*reference, 1)) / 2:.2f}"]
                row.append(f"{a.target / median[one]:.1f}")
                rows.append(row)
        header = ["data", "view", "hvdtrain img/s, 1 core", "reference img/s, 1 core", "hvdtrain / reference"]
        if len(threads) > 1:
            header += ["hvdtrain img/s, 2 cores", "2-core / (2 x 1-core)", "reference's 2-core / (2 x 1-core)"]
        header.append(f"cores per GPU at {a.target:,.0f} img/s")
        common.print_table(header, rows, f"ImageNet-like JPEGs to 224x224, local batch {a.batch_size}, "
                                         f"{a.rounds} round(s), medians")
        psnr = resize_error(folder, min(100, a.train_images))
        aa = ("hvdtrain, antialias", "folder", "train", 1)
        common.print_table(
            ["resize", "training view img/s, 1 core (folder)", "PSNR vs Lanczos-3, training crops (dB)",
             "PSNR vs Lanczos-3, center crops (dB)"],
            [["bilinear (hvdtrain)", f"{median[('hvdtrain', 'folder', 'train', 1)]:,.0f}",
              f"{psnr[('train', False)]:.1f}", f"{psnr[('test', False)]:.1f}"],
             ["bilinear, antialias", f"{median[aa]:,.0f}", f"{psnr[('train', True)]:.1f}",
              f"{psnr[('test', True)]:.1f}"]],
            f"antialiasing: speed / without = {ratio(aa, ('hvdtrain', 'folder', 'train', 1)):.2f}")


if __name__ == "__main__":
    main()
