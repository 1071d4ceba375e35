"""python -m hvdtrain.tools.make_image_folder: Fashion-MNIST as an image folder, pixels kept."""
import glob
import os

import numpy as np
import tensorflow as tf

from hvdtrain.config import DEFAULT_DATA_DIR
from hvdtrain.data.in_memory import load_idx_dir
from hvdtrain.tools.make_image_folder import folder_order, main


def test_it_writes_the_first_images_losslessly_in_folder_order(tmp_path, capsys):
    out = tmp_path / "folder"
    assert main(["--out", str(out), "--train", "30", "--test", "10"]) == 0
    assert "wrote 30 training and 10 test images" in capsys.readouterr().out
    data = load_idx_dir(DEFAULT_DATA_DIR)
    files = sorted(glob.glob(str(out / "train" / "*" / "*.png")))  # --dataset folder's order
    assert len(files) == 30 and len(glob.glob(str(out / "test" / "*" / "*.png"))) == 10
    order = folder_order(data.y_train[:30])
    for path, i in zip(files, order):
        image = tf.io.decode_png(tf.io.read_file(path)).numpy()
        np.testing.assert_array_equal(image, data.x_train[i])
        assert os.path.basename(os.path.dirname(path)) == f"class{data.y_train[i]:02d}"


def test_an_existing_folder_is_refused(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--train", "1", "--test", "1"]) == 2
    assert "exists: give a new folder" in capsys.readouterr().err
