"""Image folders in one process (hvdtrain.data.folder): the shards every rank reads, another world
size continuing at an example, and errors naming the file."""
import os

import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.data.folder import open_folder
from hvdtrain.data.sharding import ShardPlan
from hvdtrain.errors import HvdtrainError
from hvdtrain.tools.make_image_folder import folder_order
from tests.helpers.streams import epoch_of, small_folder  # noqa: F401 (fixture)


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
