"""Atomic checkpoints: round trip, keep-last-K, interrupted saves, wrong model, corrupt files."""
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.checkpoint import CheckpointManager, check_resumable
from hvdtrain.errors import HvdtrainError


def model_and_optimizer(width=4):
    model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(width), tf.keras.layers.Dense(2)])
    optimizer = tf.keras.optimizers.SGD(0.1, momentum=0.9)
    optimizer.build(model.trainable_variables)
    return model, optimizer


def test_round_trip_restores_model_and_optimizer(tmp_path):
    model, optimizer = model_and_optimizer()
    rng = np.random.default_rng(0)
    for v in optimizer.variables:  # momentum slots and the step count, none left at their initial values
        v.assign(rng.integers(1, 100) if v.dtype.is_integer else rng.standard_normal(v.shape).astype(v.dtype.name))
    manager = CheckpointManager(str(tmp_path), model, optimizer)
    manager.save(17, {"epoch": 3})
    saved = [v.numpy().copy() for v in model.variables]
    saved_slots = [v.numpy().copy() for v in optimizer.variables]

    other, other_opt = model_and_optimizer()
    meta = CheckpointManager(str(tmp_path), other, other_opt).restore(manager.latest())
    assert meta["epoch"] == 3
    assert len(saved) == len(other.variables) == 4 and len(saved_slots) == len(other_opt.variables) == 5
    for a, b in zip(saved + saved_slots, other.variables + other_opt.variables):
        np.testing.assert_array_equal(a, b.numpy())


def test_keeps_last_k(tmp_path):
    manager = CheckpointManager(str(tmp_path), *model_and_optimizer(), keep=2)
    for tag in (1, 2, 3, 4):
        manager.save(tag, {"epoch": tag})
    assert [t for t, _ in manager.completed()] == [3, 4]


def test_crash_during_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    model, optimizer = model_and_optimizer()
    manager = CheckpointManager(str(tmp_path), model, optimizer)
    manager.save(1, {"epoch": 1})

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(manager._checkpoint, "write", crash)
    with pytest.raises(KeyboardInterrupt):
        manager.save(2, {"epoch": 2})
    assert manager.latest().endswith("ckpt-000001")
    assert any(name.startswith(".tmp-ckpt-000002") for name in os.listdir(tmp_path))
    assert CheckpointManager(str(tmp_path), *model_and_optimizer()).restore(manager.latest())["epoch"] == 1
    # The next run (another process: here, the leftover renamed to another pid) removes the leftover.
    monkeypatch.undo()
    leftover = [n for n in os.listdir(tmp_path) if n.startswith(".tmp")][0]
    os.rename(tmp_path / leftover, tmp_path / ".tmp-ckpt-000002-1")
    manager.save(3, {"epoch": 3})
    assert not any(name.startswith(".tmp") for name in os.listdir(tmp_path))


def test_crash_between_the_renames_of_a_re_save_keeps_the_checkpoint(tmp_path):
    """Re-saving a tag renames the old copy aside, then the new one into place: a crash between the
    two leaves only ckpt-N.old-<pid>, which the next manager puts back (or drops, if ckpt-N is back)."""
    model, optimizer = model_and_optimizer()
    CheckpointManager(str(tmp_path), model, optimizer).save(1, {"epoch": 1})
    os.rename(tmp_path / "ckpt-000001", tmp_path / "ckpt-000001.old-4242")
    manager = CheckpointManager(str(tmp_path), *model_and_optimizer())
    assert manager.latest() == str(tmp_path / "ckpt-000001")
    assert manager.restore(manager.latest())["epoch"] == 1
    shutil.copytree(tmp_path / "ckpt-000001", tmp_path / "ckpt-000001.old-4243")
    CheckpointManager(str(tmp_path), *model_and_optimizer())
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000001"]


def test_a_re_save_that_cannot_be_put_back_is_an_error_and_keeps_the_copy(tmp_path):
    """If ``ckpt-N`` cannot be replaced by its ``.old-<pid>`` copy (here a regular file is in the
    way), the manager stops with the reason and leaves the copy and the blocker as they were."""
    CheckpointManager(str(tmp_path), *model_and_optimizer()).save(1, {"epoch": 1})
    os.rename(tmp_path / "ckpt-000001", tmp_path / "ckpt-000001.old-4242")
    (tmp_path / "ckpt-000001").write_text("in the way")
    with pytest.raises(HvdtrainError, match=r"cannot restore interrupted checkpoint .*ckpt-000001.old-4242 as "
                                            r".*ckpt-000001: Not a directory"):
        CheckpointManager(str(tmp_path), *model_and_optimizer())
    assert (tmp_path / "ckpt-000001").read_text() == "in the way"
    copy = tmp_path / "ckpt-000001.old-4242"
    assert (copy / "meta.json").is_file()
    (tmp_path / "ckpt-000001").unlink()  # once the blocker is gone, the next manager puts the copy back
    manager = CheckpointManager(str(tmp_path), *model_and_optimizer())
    assert manager.restore(manager.latest())["epoch"] == 1


def test_checkpoint_of_another_model_is_refused(tmp_path):
    manager = CheckpointManager(str(tmp_path), *model_and_optimizer(width=4))
    manager.save(1, {"epoch": 1, "model": "small"})
    with pytest.raises(HvdtrainError, match="written by another model"):
        CheckpointManager(str(tmp_path), *model_and_optimizer(width=5)).restore(manager.latest())


def test_corrupt_checkpoint_is_refused(tmp_path):
    manager = CheckpointManager(str(tmp_path), *model_and_optimizer())
    path = manager.save(1, {"epoch": 1})
    data = [f for f in os.listdir(path) if f.startswith("state.data")][0]
    with open(os.path.join(path, data), "r+b") as f:
        f.truncate(10)
    # The damaged file is named, not only its checkpoint's folder.
    with pytest.raises(HvdtrainError, match=rf"corrupt or incompatible: {path}/{data} \(tensor .*\) is damaged: "):
        CheckpointManager(str(tmp_path), *model_and_optimizer()).restore(path)
    with open(os.path.join(path, "state.index"), "r+b") as f:
        f.truncate(10)
    with pytest.raises(HvdtrainError, match=rf"corrupt or incompatible: {path}/state.index is damaged: "):
        CheckpointManager(str(tmp_path), *model_and_optimizer()).restore(path)
    with open(os.path.join(path, "meta.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(HvdtrainError, match="unreadable"):
        CheckpointManager(str(tmp_path), *model_and_optimizer()).restore(path)


def test_a_corrupt_latest_checkpoint_names_the_one_before_it(tmp_path):
    manager = CheckpointManager(str(tmp_path), *model_and_optimizer())
    manager.save(1, {"epoch": 1})
    path = manager.save(2, {"epoch": 2})
    data = [f for f in os.listdir(path) if f.startswith("state.data")][0]
    with open(os.path.join(path, data), "r+b") as f:
        f.truncate(10)
    fresh = CheckpointManager(str(tmp_path), *model_and_optimizer())
    with pytest.raises(HvdtrainError, match=r"corrupt or incompatible: .*; ckpt-000001 before it is still there: "
                                            r"move ckpt-000002 out of .* to resume from ckpt-000001"):
        fresh.restore_latest()
    shutil.move(path, tmp_path.parent / "set-aside")
    assert fresh.restore_latest()[1]["epoch"] == 1


def test_a_directory_under_a_file_is_refused_naming_the_file(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(HvdtrainError, match=f"checkpoint directory {blocker}/sub: {blocker} is a file, not a directory"):
        CheckpointManager(str(blocker / "sub"), *model_and_optimizer())


def test_check_resumable_names_each_difference_and_skips_what_older_checkpoints_lack():
    ours = {"batch_size": 64, "seed": 0, "data": {"train_examples": 10, "digest": "ab"}}
    check_resumable("ckpt", {"batch_size": 64, "seed": 0}, ours)  # written before data fingerprints
    with pytest.raises(HvdtrainError, match=r"seed: 0 here, 1 there; data.digest: 'ab' here, 'cd' there\)"):
        check_resumable("ckpt", {"batch_size": 64, "seed": 1, "data": {"train_examples": 10, "digest": "cd"}}, ours)
