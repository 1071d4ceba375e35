"""python -m hvdtrain.tools.make_segmentation: Fashion-MNIST with a class per pixel, written whole."""
import numpy as np

from hvdtrain.config import DEFAULT_DATA_DIR
from hvdtrain.data.in_memory import load_idx_dir
from hvdtrain.tools.make_segmentation import main


def test_each_bright_pixel_is_its_images_class_plus_one_and_the_rest_background(tmp_path, capsys):
    out = tmp_path / "seg.npz"
    assert main(["--out", str(out), "--train", "20", "--test", "5"]) == 0
    assert "20 train / 5 test images" in capsys.readouterr().out
    seg, data = np.load(out), load_idx_dir(DEFAULT_DATA_DIR)
    np.testing.assert_array_equal(seg["x_train"], data.x_train[:20, ..., 0])
    expected = np.where(data.x_train[:20, ..., 0] > 32, data.y_train[:20, None, None] + 1, 0)
    np.testing.assert_array_equal(seg["y_train"], expected)
    assert seg["y_test"].shape == (5, 28, 28) and sorted(p.name for p in tmp_path.iterdir()) == ["seg.npz"]


def test_a_bad_threshold_is_one_error(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "x.npz"), "--threshold", "255"]) == 2
    assert "--threshold must be in [0, 255), got 255" in capsys.readouterr().err
