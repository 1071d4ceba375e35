"""TrainPosition: the one training position checkpoints, resumes and elastic commits share."""
import numpy as np
import pytest

from hvdtrain.position import TrainPosition


def test_position_round_trips_through_checkpoint_meta():
    position = TrainPosition(epoch=2, step=5, example=640, epoch_sums=np.array([1.5, 640.0, 600.0, 640.0]),
                             sums_layout=("sparse_categorical_crossentropy", "accuracy:2"))
    meta = position.to_meta()
    assert meta == {"epoch": 2, "step_in_epoch": 5, "example_in_epoch": 640, "epoch_sums": [1.5, 640.0, 600.0, 640.0],
                    "epoch_sums_layout": ["sparse_categorical_crossentropy", "accuracy:2"]}
    assert TrainPosition.from_meta(meta, num_examples=60000) == position
    assert "epoch_sums" not in position.to_meta(sums=False)


def test_an_epochs_start_has_no_sums_and_is_not_mid_epoch():
    start = TrainPosition(3)
    assert not start.mid_epoch and start.to_meta() == {"epoch": 3, "step_in_epoch": 0, "example_in_epoch": 0}
    assert TrainPosition(0, 0, 10).mid_epoch and TrainPosition(0, 1, 0).mid_epoch


@pytest.mark.parametrize("meta, example", [
    ({"epoch": 1, "step_in_epoch": 4, "world_size": 2, "batch_size": 64}, 512),   # 4 global batches of 128
    ({"epoch": 1, "step_in_epoch": 9, "world_size": 2, "batch_size": 64}, 1000),  # capped at the epoch's end
])
def test_checkpoints_without_example_in_epoch_give_it_from_their_global_batch(meta, example):
    assert TrainPosition.from_meta(meta, num_examples=1000).example == example


def test_sums_of_checkpoints_from_before_chosen_metrics_take_the_default_objectives_layout():
    meta = {"epoch": 1, "step_in_epoch": 4, "example_in_epoch": 512, "epoch_sums": [30.0, 400.0, 512.0],
            "config": {"epochs": 2}}  # (loss sum, correct, count); its config has no task
    legacy = TrainPosition.from_meta(meta, 1000)
    assert legacy.epoch_sums == (30.0, 512.0, 400.0, 512.0)
    assert legacy.sums_layout == ("sparse_categorical_crossentropy", "accuracy:2")
    meta["config"]["task"] = {"loss": "mse", "metrics": ""}  # three sums of today's layout are left as they are
    assert TrainPosition.from_meta(meta, 1000).epoch_sums == (30.0, 400.0, 512.0)


def test_position_is_immutable_and_hashable():
    position = TrainPosition(1, 2, 3, [1, 2, 3])
    with pytest.raises(AttributeError):
        position.epoch = 2
    assert position.epoch_sums == (1.0, 2.0, 3.0) and hash(position) == hash(TrainPosition(1, 2, 3, (1, 2, 3)))
