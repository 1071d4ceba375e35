"""python -m hvdtrain.tools.make_tfrecords: an image folder as TFRecord shards, every image and label kept."""
import os


from hvdtrain.data.folder import open_folder
from hvdtrain.tools import make_tfrecords
from tests.helpers.streams import epoch_of, open_records, small_folder  # noqa: F401 (fixture)


def test_make_tfrecords_keeps_every_image_and_label(tmp_path, small_folder):
    root, data = small_folder
    assert make_tfrecords.main(["--folder", root, "--out", str(tmp_path / "rec"), "--shards", "3"]) == 0
    assert sorted(os.listdir(tmp_path / "rec")) == ["test-00000-of-00001", *[f"train-0000{k}-of-00003" for k in range(3)]]
    assert make_tfrecords.main(["--folder", root, "--out", str(tmp_path / "rec"), "--shards", "2"]) == 2, \
        "an earlier conversion's shards would be read too"
    records = open_records(tmp_path / "rec")
    folder = open_folder(root, 0, "none", 0)
    assert records.num_train == folder.num_train == 23 and records.num_classes == folder.num_classes == 3
    ranks, _ = epoch_of(records, 1, 23, 0)
    x, y = ranks[0][0]
    pairs = sorted((int(label), image.tobytes()) for image, label in zip(x, y))
    assert pairs == sorted((int(label), image.tobytes()) for image, label in zip(data.x_train, data.y_train))
