"""hvdtrain.tools.input_speed: the training pipeline's img/s with no model, and cores per GPU."""
import re
import subprocess
import sys

import numpy as np
import pytest

from hvdtrain.tools import input_speed
from hvdtrain.tools import make_tfrecords
from hvdtrain.tools.make_image_folder import write_image_folder
from tests.helpers.ranks import REPO, rank_env


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory):
    """60 training and 20 test 40x52 JPEGs in 3 classes, as a folder and as TFRecords."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (80, 40, 52, 3), dtype=np.uint8)
    y = np.arange(80) % 3
    root = tmp_path_factory.mktemp("jpegs")
    folder = write_image_folder(root / "folder", x[:60], y[:60], x[60:], y[60:], quality=90)
    make_tfrecords.main(["--folder", folder, "--out", str(root / "records"), "--shards", "2"])
    return {"folder": folder, "tfrecord": str(root / "records")}


def run(*args):
    return subprocess.run([sys.executable, "-m", "hvdtrain.tools.input_speed", *args], cwd=REPO, env=rank_env(None),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("kind", ["folder", "tfrecord"])
@pytest.mark.parametrize("split", ["train", "test"])
def test_prints_images_per_second_and_cores_per_gpu(jpegs, kind, split):
    result = run("--dataset", kind, "--data-dir", jpegs[kind], "--image-size", "32", "--augment", "standard",
                 "--split", split, "--batch-size", "8", "--target", "3000")
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.splitlines()
    rate = float(re.fullmatch(r"([\d,]+) img/s on 1 thread\(s\)", first).group(1).replace(",", ""))
    cores = re.fullmatch(r"([\d.]+) cores per GPU at 3,000 img/s \(([\d,]+) img/s per core; (\d+) of the "
                         rf"{split} split's (\d+) images timed on 1 core\(s\)\)", second)
    assert cores, second
    assert cores.group(3) == cores.group(4) == ("60" if split == "train" else "20")
    assert abs(float(cores.group(2).replace(",", "")) - rate) <= 1
    # Cores are the true rate's 3000 / rate rounded up to a tenth; the printed rate is rounded to a unit.
    assert 3000 / (rate + 0.5) - 1e-9 <= float(cores.group(1)) <= 3000 / (rate - 0.5) + 0.1 + 1e-9


def test_reads_the_batches_a_training_run_reads(jpegs):
    """The tool's batches are the training pipeline's: same images, same views, in order."""
    from hvdtrain.config import DataConfig

    data = DataConfig(dataset="folder", data_dir=jpegs["folder"], image_size=32, augment="standard")
    batches, count, _ = input_speed.batches(data, "train", 16, 1)
    images = np.concatenate([b[0].numpy() for b in batches])
    assert count == 60 and images.shape == (60, 32, 32, 3) and images.dtype == np.uint8
    again = np.concatenate([b[0].numpy() for b in input_speed.batches(data, "train", 16, 1)[0]])
    np.testing.assert_array_equal(images, again)  # (seed, epoch, example): the same views each time


def test_stops_after_images(jpegs):
    result = run("--dataset", "folder", "--data-dir", jpegs["folder"], "--batch-size", "8", "--images", "16")
    assert result.returncode == 0, result.stderr
    assert "16 of the train split's 60 images timed" in result.stdout


@pytest.mark.parametrize("args,message", [
    (["--dataset", "folder", "--data-dir", "/nonexistent"], "input_speed: error: --data-dir /nonexistent is not a directory"),
    (["--dataset", "folder", "--data-dir", ".", "--threads", "0"], "--threads must be >= 1, got 0"),
    (["--dataset", "npz", "--data-dir", "."], "invalid choice: 'npz'"),
])
def test_bad_input_is_one_clear_error(args, message):
    result = run(*args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_an_image_that_does_not_decode_is_one_clear_error(jpegs, tmp_path):
    import shutil

    folder = shutil.copytree(jpegs["folder"], tmp_path / "folder")
    broken = sorted((folder / "train" / "class01").iterdir())[0]
    broken.write_bytes(b"\xff\xd8\xff\xe0 cut short")
    result = run("--dataset", "folder", "--data-dir", str(folder), "--image-size", "32", "--augment", "standard")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"input_speed: error: image {broken}: Invalid JPEG data" in result.stderr and "(epoch 1, step " in result.stderr
