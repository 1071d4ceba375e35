"""Data functions in one process (hvdtrain.data.function, --data): exact shards, label maps, and
errors naming the function or example."""

import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.data.labels import check_labels
from hvdtrain.data.function import open_function
from hvdtrain.data.sharding import ShardPlan
from hvdtrain.errors import HvdtrainError
from tests.helpers.streams import epoch_of


def test_data_function_is_sharded_exactly():
    dataset = open_function("tests.helpers.datafns:counted", 0, 3, 0, 0, check_labels)
    assert (dataset.num_train, dataset.num_test, dataset.num_classes, dataset.input_shape) == (13, 5, 3, (4, 4, 1))
    ranks, plans = epoch_of(dataset, 3, 2, 0)
    values = np.concatenate([x[:, 0, 0, 0] for r in ranks for x, _ in r])
    assert sorted(values.tolist()) == list(range(13))
    assert {len(r) for r in ranks} == {plans[0].steps_per_epoch}
    counted = open_function("tests.helpers.datafns:unknown_length", 0, 3, 0, 0, check_labels)
    assert counted.num_train == 13 and counted.num_classes == 3


def test_a_data_function_may_give_a_class_per_pixel():
    dataset = open_function("tests.helpers.datafns:counted_maps", 0, 2, 0, 0, check_labels)
    assert (dataset.label_shape, dataset.num_classes) == ((4, 4), 3)
    assert dataset.fingerprint()["label_shape"] == [4, 4]
    ranks, _ = epoch_of(dataset, 2, 2, 0)
    for x, y in ranks[0] + ranks[1]:
        assert y.shape == (len(x), 4, 4) and y.dtype == np.int32
        np.testing.assert_array_equal(y[:, :, 0], (x[:, 0, 0, 0][:, None].astype(int) + np.arange(4)) % 3)


@pytest.mark.parametrize("name, message", [
    ("raises", r"--data tests.helpers.datafns:raises: the function raised FileNotFoundError: gs://no-such-bucket/train-\*"),
    ("images_only", r"elements must be \(image, label\) pairs"),
    ("batched", r"the dataset is batched \(images \(None, 4, 4, 1\)\)"),
    ("not_a_dataset", r"must return a tf.data.Dataset, got ndarray"),
    ("infinite", r"\(split 'train'\): the dataset is infinite \(.repeat\(\)\?\): return one pass of the split"),
    ("nowhere", r"--data 'tests.helpers.datafns:nowhere': module 'tests.helpers.datafns' has no function 'nowhere'"),
])
def test_bad_data_functions(name, message):
    with pytest.raises(HvdtrainError, match=message):
        open_function(f"tests.helpers.datafns:{name}", 0, 1, 0, 0, check_labels)


def test_data_function_label_out_of_range_names_the_example():
    dataset = open_function("tests.helpers.datafns:label_out_of_range", 0, 1, 0, 3, check_labels)
    plan = ShardPlan(dataset.num_train, 13, 1, 0, shuffle=False)
    batches, _ = dataset.train_batches(plan, 0)
    with pytest.raises(tf.errors.OpError) as raised:
        list(batches)
    error = str(dataset.failed_step(raised.value, plan, 0, 0, 0))
    assert "example 2 (0-based) of split 'train'" in error and "label not below the 3 classes" in error, error
