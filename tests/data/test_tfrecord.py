"""TFRecord shards in one process (hvdtrain.data.tfrecord): exact shards for any world size, resume
mid-epoch, parallel readers in one reader's order, the cached index, and errors naming the file and record."""
import json
import re

import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.data import tfrecord
from hvdtrain.data.sharding import ShardPlan
from hvdtrain.errors import HvdtrainError
from hvdtrain.tools import make_tfrecords
from tests.helpers.streams import epoch_of, open_records, write_records


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


def interleaved(segments, cycle):
    """tf.data's interleave (block length 1) of ``(file, skip, take)`` segments' keys, in Python:
    a slot whose file ends is refilled with the next segment when the cycle comes back to it."""
    inputs = iter([[(f << 32) + skip + i for i in range(take)] for f, skip, take in segments])
    slots, keys, index, exhausted = [None] * cycle, [], 0, False
    while not exhausted or any(slot is not None for slot in slots):
        if slots[index] is not None:
            key = next(slots[index], None)
            if key is not None:
                keys.append(key)
            else:
                slots[index] = None
            index = (index + 1) % cycle
        elif not exhausted:
            segment = next(inputs, None)
            exhausted = segment is None
            slots[index] = None if exhausted else iter(segment)
        else:
            index = (index + 1) % cycle
    return keys


def test_tfrecord_parallel_readers_keep_the_interleave_order(tmp_path):
    """Up to FILES_AT_ONCE readers, one per thread, give the keys in the order of one reader:
    tf.data's interleave of the segments, which exact resume relies on."""
    write_records(tmp_path, [5, 9, 3, 8, 6, 4])
    write_records(tmp_path, [2], prefix="test")
    split = open_records(tmp_path).train
    segments = [(0, 1, 4), (1, 0, 9), (2, 0, 3), (3, 2, 6), (4, 0, 6), (5, 0, 1)]
    expected = interleaved(segments, tfrecord.FILES_AT_ONCE)
    assert expected != sorted(expected)
    for threads in (1, 2, 4, 8):
        records = split._read(segments, tfrecord.FILES_AT_ONCE, threads)
        assert ("Parallel" in type(records).__name__) == (threads > 1), (threads, type(records).__name__)
        assert [int(key) for _, key in records] == expected, threads


def test_tfrecord_training_batches_are_alike_on_any_number_of_threads(tmp_path):
    write_records(tmp_path, [5, 9, 3, 8, 6])
    write_records(tmp_path, [4, 7], prefix="test")
    dataset = open_records(tmp_path)
    plan = ShardPlan(dataset.num_train, 3, 2, 1, seed=3)
    runs = [dataset.train_batches(plan, 1, threads=threads) for threads in (1, 2, 4)]
    batches = [[x.numpy()[:, 0, 0, 0].tolist() for x, _ in data] for data, _ in runs]
    assert batches[0] == batches[1] == batches[2]
    assert list(map(len, batches[0])) == runs[0][1]


def test_tfrecord_an_image_that_does_not_decode_is_named_by_its_file_and_record(tmp_path):
    """Read by two threads, parsed and decoded in parallel: the failed step names the record."""
    write_records(tmp_path, [6, 6], broken=(9,))  # train-00001's fourth record
    write_records(tmp_path, [2], prefix="test")
    dataset = open_records(tmp_path)
    plan = ShardPlan(dataset.num_train, 3, 1, 0, seed=3)
    read = 0
    with pytest.raises(tf.errors.OpError) as failure:
        for _ in dataset.train_batches(plan, 0, threads=2)[0]:
            read += 1
    error = dataset.failed_step(failure.value, plan, 0, read, 0)
    assert re.fullmatch(rf"{tmp_path}/train-00001: record 4 \(1-based\): .+ \(epoch 1, step {read + 1}\)",
                        str(error)), str(error)


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
