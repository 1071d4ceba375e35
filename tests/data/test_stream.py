"""Streaming datasets in one process: the shards every rank would read (exact, equal steps), image
views, the TFRecord index, and the errors for bad files. Multi-rank training runs are in
tests/test_streaming.py."""
import json
import os

import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.data.datasets import make_synthetic
from hvdtrain.data.labels import check_labels
from hvdtrain.data.folder import open_folder
from hvdtrain.data.function import open_function
from hvdtrain.data.sharding import ShardPlan
from hvdtrain.data import tfrecord
from hvdtrain.errors import HvdtrainError
from hvdtrain.tools import make_tfrecords
from tests.image_files import folder_order, write_image_folder


def write_records(directory, counts, prefix="train", label_of=lambda i: i % 3, shape=(4, 4, 1)):
    """TFRecord files ``<prefix>-<k>`` of ``counts[k]`` records; record ``i`` overall has a PNG of
    value ``i % 256`` and label ``label_of(i)``. Returns the paths."""
    paths, i = [], 0
    for k, n in enumerate(counts):
        path = os.path.join(directory, f"{prefix}-{k:05d}")
        with tf.io.TFRecordWriter(path) as writer:
            for _ in range(n):
                png = tf.io.encode_png(np.full(shape, i % 256, np.uint8)).numpy()
                writer.write(make_tfrecords._example(tf, png, label_of(i), "c", f"{i}.png").SerializeToString())
                i += 1
        paths.append(path)
    return paths


def open_records(directory, **kwargs):
    train, test = tfrecord.find_files(str(directory))
    index, scanned = tfrecord.load_index(str(directory), train + test, "image/encoded", "image/class/label")
    args = dict(num_classes=0, image_size=0, augment="none", shuffle_buffer=7, seed=3, check_labels=check_labels)
    args.update(kwargs)
    opened = tfrecord.open_tfrecords(str(directory), index, "image/encoded", "image/class/label", **args)
    if scanned:
        tfrecord.save_index(str(directory), index, "image/encoded", "image/class/label")
    return opened


def epoch_of(dataset, world_size, batch, epoch, first_step=0, first_example=0):
    """Every rank's batches of ``epoch`` (as ``[rank][step] -> (images, labels)``), and the plans."""
    plans = [ShardPlan(dataset.num_train, batch, world_size, r, seed=3) for r in range(world_size)]
    ranks = []
    for plan in plans:
        batches, sizes = dataset.train_batches(plan, epoch, first_step, first_example)
        got = [(x.numpy(), y.numpy()) for x, y in batches]
        assert [len(y) for _, y in got] == sizes
        ranks.append(got)
    return ranks, plans


@pytest.mark.parametrize("world_size, batch", [(5, 2), (2, 4), (3, 1)])
def test_tfrecord_shards_are_exact_with_uneven_files_and_more_ranks_than_files(tmp_path, world_size, batch):
    """Files of 1, 7 and 12 records (20), 5 ranks of local batch 2: every record is read by exactly
    one rank each epoch, every rank runs the plan's steps, each step's global batch has the plan's
    size, and the order is a function of (seed, epoch)."""
    write_records(tmp_path, [1, 7, 12])
    write_records(tmp_path, [4], prefix="test")
    dataset = open_records(tmp_path)
    assert dataset.num_train == 20 and dataset.num_test == 4 and dataset.num_classes == 3
    orders = []
    for epoch in (0, 1, 0):
        ranks, plans = epoch_of(dataset, world_size, batch, epoch)
        assert {len(r) for r in ranks} == {plans[0].steps_per_epoch}, "equal steps on every rank"
        for step in range(plans[0].steps_per_epoch):
            assert sum(len(r[step][1]) for r in ranks) == plans[0].global_batch_size(step)
        values = np.concatenate([x[:, 0, 0, 0] for r in ranks for x, _ in r])
        assert sorted(values.tolist()) == list(range(20)), "every record once"
        labels = np.concatenate([y for r in ranks for _, y in r])
        assert np.array_equal(labels, values % 3), "each image with its own label"
        orders.append(values.tolist())
    assert orders[0] == orders[2] and orders[0] != orders[1], "shuffled per epoch, as a function of (seed, epoch)"


def test_tfrecord_resume_mid_epoch_continues_the_same_stream(tmp_path):
    write_records(tmp_path, [9, 9])
    write_records(tmp_path, [3], prefix="test")
    dataset = open_records(tmp_path)
    whole, _ = epoch_of(dataset, 2, 2, epoch=1)
    resumed, _ = epoch_of(dataset, 2, 2, epoch=1, first_step=2)
    for rank in range(2):
        assert [y.tolist() for _, y in resumed[rank]] == [y.tolist() for _, y in whole[rank][2:]]
    # A --resume's position: the step and its first example (4 examples per global batch).
    at_step, _ = epoch_of(dataset, 2, 2, epoch=1, first_step=2, first_example=8)
    assert [[y.tolist() for _, y in r] for r in at_step] == [[y.tolist() for _, y in r] for r in resumed]
    # Each rank reads its own range of the stream: an example inside a step (an elastic position
    # of another world size) is refused (the config refuses --elastic with TFRecords).
    with pytest.raises(ValueError, match="resumes at a step, not at example 5"):
        epoch_of(dataset, 2, 2, epoch=1, first_step=1, first_example=5)


def test_tfrecord_index_is_cached_and_rebuilt_when_a_file_changes(tmp_path):
    write_records(tmp_path, [5, 6])
    write_records(tmp_path, [2], prefix="test")
    assert open_records(tmp_path).num_train == 11
    cache = json.loads((tmp_path / tfrecord.INDEX_FILE).read_text())
    assert cache["files"]["train-00001"]["records"] == 6
    write_records(tmp_path, [5, 8])  # train-00001 rewritten, longer
    assert open_records(tmp_path).num_train == 13


def test_tfrecord_bad_files_name_the_file_and_record(tmp_path):
    train = write_records(tmp_path, [3, 4])
    write_records(tmp_path, [2], prefix="test")
    data = open(train[1], "rb").read()
    with open(train[1], "wb") as f:
        f.write(data[:-20])
    with pytest.raises(HvdtrainError, match=r"train-00001: record 4 \(1-based\) is truncated or corrupt, after 3 good record\(s\)"):
        open_records(tmp_path)
    with tf.io.TFRecordWriter(train[1]) as writer:
        png = tf.io.encode_png(np.zeros((4, 4, 1), np.uint8)).numpy()
        writer.write(make_tfrecords._example(tf, png, 1, "c", "a.png").SerializeToString())
        writer.write(tf.train.Example(features=tf.train.Features(feature={
            "image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[png]))})).SerializeToString())
    with pytest.raises(HvdtrainError, match=r"train-00001: record 2 \(1-based\): .*image/class/label"):
        open_records(tmp_path)


def test_tfrecord_label_beyond_the_classes(tmp_path):
    write_records(tmp_path, [6], label_of=lambda i: 12 if i == 4 else i % 3)
    write_records(tmp_path, [2], prefix="test")
    with pytest.raises(HvdtrainError, match=r"no training example has class 3, 4, 5, 6, 7 and 4 more"):
        open_records(tmp_path)
    with pytest.raises(HvdtrainError, match=r"labels must be in \[0, 3\), found range \[0, 12\]: 12 at the training split"):
        open_records(tmp_path, num_classes=3)


@pytest.fixture(scope="module")
def small_folder(tmp_path_factory):
    data = make_synthetic(num_train=23, num_test=7, image_shape=(6, 6, 1), num_classes=3, seed=1)
    root = write_image_folder(tmp_path_factory.mktemp("folder"), data.x_train, data.y_train, data.x_test,
                              data.y_test, fmt="png")
    return root, data


@pytest.mark.parametrize("world_size, batch", [(3, 2), (2, 5)])
def test_folder_ranks_read_what_memory_would(small_folder, world_size, batch):
    """Each step, the ranks' batches of an image folder (PNG: lossless) are, rank after rank,
    exactly the global batch one process takes from the same examples in memory."""
    root, data = small_folder
    dataset = open_folder(root, image_size=0, augment="none", seed=3)
    order = folder_order(data.y_train)
    x, y = data.x_train[order], data.y_train[order]
    single = ShardPlan(len(y), batch * world_size, 1, 0, seed=3)
    ranks, plans = epoch_of(dataset, world_size, batch, epoch=1)
    for step, indices, _ in single.epoch(1):
        assert np.array_equal(np.concatenate([r[step][0] for r in ranks]), x[indices])
        assert np.array_equal(np.concatenate([r[step][1] for r in ranks]), y[indices])
    test = np.concatenate([b[0].numpy() for r in range(world_size) for b in dataset.test_batches(world_size, r, 2)])
    assert np.array_equal(test, data.x_test[folder_order(data.y_test)])


def test_folder_continues_at_an_example_of_another_world_size(small_folder):
    """An elastic job that goes from 2 ranks to 3 after 7 examples of epoch 1: the 3 ranks read,
    step after step, the rest of the epoch's permutation (as in memory), each example once."""
    root, data = small_folder
    dataset = open_folder(root, image_size=0, augment="none", seed=3)
    order = folder_order(data.y_train)
    y = data.y_train[order]
    plans = [ShardPlan(len(y), 2, 3, r, seed=3) for r in range(3)]
    first = plans[0].start_step(0, 7)
    ranks, _ = epoch_of(dataset, 3, 2, epoch=1, first_step=first, first_example=7)
    rest = plans[0].permutation(1)[7:]
    taken = [np.concatenate([r[i][1] for r in ranks]) for i in range(len(ranks[0]))]
    assert np.array_equal(np.concatenate(taken), y[rest]), "the rest of the epoch, in order, once"
    assert [len(t) for t in taken] == [plans[0].global_batch_size(s, 7) for s in range(first, plans[0].steps_per_epoch)]


def test_folder_errors(tmp_path, small_folder):
    root, data = small_folder
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(root, bad)
    os.makedirs(bad / "train" / "class03")
    with pytest.raises(HvdtrainError, match=r"class folder .*train/class03 holds no images"):
        open_folder(str(bad), 0, "none", 0)
    os.rmdir(bad / "train" / "class03")
    os.makedirs(bad / "test" / "zebra")
    (bad / "test" / "zebra" / "z.png").write_bytes((bad / "test" / "class00").iterdir().__next__().read_bytes())
    with pytest.raises(HvdtrainError, match=r"class folder\(s\) \['zebra'\] are not among the training split's 3"):
        open_folder(str(bad), 0, "none", 0)
    shutil.rmtree(bad / "test")
    with pytest.raises(HvdtrainError, match="no test split"):
        open_folder(str(bad), 0, "none", 0)


def test_folder_failures_in_the_pipeline_name_the_file(tmp_path, small_folder):
    """An undecodable image, and an image of another size without --image-size, fail the step
    that reads them with an error naming the file."""
    root, _ = small_folder
    import shutil

    for case in ("undecodable", "other size"):
        bad = tmp_path / case.replace(" ", "_")
        shutil.copytree(root, bad)
        victim = sorted((bad / "train" / "class01").iterdir())[2]
        if case == "undecodable":
            victim.write_bytes(b"\xff\xd8\xff\xe0 not really a JPEG")
        else:
            victim.write_bytes(tf.io.encode_png(np.zeros((9, 6, 1), np.uint8)).numpy())
        dataset = open_folder(str(bad), 0, "none", 0)
        plan = ShardPlan(dataset.num_train, 4, 1, 0, seed=0)
        batches, _ = dataset.train_batches(plan, 0)
        done = 0
        with pytest.raises(tf.errors.OpError) as raised:
            for _ in batches:
                done += 1
        error = dataset.failed_step(raised.value, plan, 0, done, 0)
        expected = "Invalid JPEG data" if case == "undecodable" else "[9,6,1] is not compatible with expected shape [6,6,1]"
        assert str(victim) in str(error) and expected in str(error), str(error)
        assert (case == "other size") == str(error).endswith("images of different sizes need --image-size")


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


def test_data_function_is_sharded_exactly():
    dataset = open_function("tests.datafns:counted", 0, 3, 0, 0, check_labels)
    assert (dataset.num_train, dataset.num_test, dataset.num_classes, dataset.input_shape) == (13, 5, 3, (4, 4, 1))
    ranks, plans = epoch_of(dataset, 3, 2, 0)
    values = np.concatenate([x[:, 0, 0, 0] for r in ranks for x, _ in r])
    assert sorted(values.tolist()) == list(range(13))
    assert {len(r) for r in ranks} == {plans[0].steps_per_epoch}
    counted = open_function("tests.datafns:unknown_length", 0, 3, 0, 0, check_labels)
    assert counted.num_train == 13 and counted.num_classes == 3


def test_a_data_function_may_give_a_class_per_pixel():
    dataset = open_function("tests.datafns:counted_maps", 0, 2, 0, 0, check_labels)
    assert (dataset.label_shape, dataset.num_classes) == ((4, 4), 3)
    assert dataset.fingerprint()["label_shape"] == [4, 4]
    ranks, _ = epoch_of(dataset, 2, 2, 0)
    for x, y in ranks[0] + ranks[1]:
        assert y.shape == (len(x), 4, 4) and y.dtype == np.int32
        np.testing.assert_array_equal(y[:, :, 0], (x[:, 0, 0, 0][:, None].astype(int) + np.arange(4)) % 3)


@pytest.mark.parametrize("name, message", [
    ("raises", r"--data tests.datafns:raises: the function raised FileNotFoundError: gs://no-such-bucket/train-\*"),
    ("images_only", r"elements must be \(image, label\) pairs"),
    ("batched", r"the dataset is batched \(images \(None, 4, 4, 1\)\)"),
    ("not_a_dataset", r"must return a tf.data.Dataset, got ndarray"),
    ("infinite", r"\(split 'train'\): the dataset is infinite \(.repeat\(\)\?\): return one pass of the split"),
    ("nowhere", r"--data 'tests.datafns:nowhere': module 'tests.datafns' has no function 'nowhere'"),
])
def test_bad_data_functions(name, message):
    with pytest.raises(HvdtrainError, match=message):
        open_function(f"tests.datafns:{name}", 0, 1, 0, 0, check_labels)


def test_data_function_label_out_of_range_names_the_example():
    dataset = open_function("tests.datafns:label_out_of_range", 0, 1, 0, 3, check_labels)
    plan = ShardPlan(dataset.num_train, 13, 1, 0, shuffle=False)
    batches, _ = dataset.train_batches(plan, 0)
    with pytest.raises(tf.errors.OpError) as raised:
        list(batches)
    error = str(dataset.failed_step(raised.value, plan, 0, 0, 0))
    assert "example 2 (0-based) of split 'train'" in error and "label not below the 3 classes" in error, error
