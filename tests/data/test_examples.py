"""Examples in Keras' fit forms (hvdtrain.data.examples): structure, exact shards, padding, errors."""
import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.data.examples import Examples, StreamedExamples, class_weights, gather_rows, padded_batches
from hvdtrain.data.sharding import ShardPlan
from hvdtrain.errors import HvdtrainError
from hvdtrain.keras_recipe import examples_from


def test_nests_of_any_dtype_are_gathered_by_rows_and_ragged_rows_padded_per_batch():
    x = {"ids": tf.ragged.constant([[1, 2, 3], [4], [5, 6]]), "text": np.array(["a b", "c", "d e f"]),
         "num": np.arange(6, dtype=np.float32).reshape(3, 2)}
    examples = Examples((x, np.array([0, 1, 0])))
    assert examples.structure == ["x['ids'] int32 (None)", "x['num'] float32 (2)", "x['text'] string ()", "y int64 ()"]
    x_batch, y_batch = gather_rows(examples.on_device(examples.train), tf.constant([2, 1]))
    np.testing.assert_array_equal(x_batch["ids"].numpy(), [[5, 6], [4, 0]])  # padded to the batch's longest
    assert [t.decode() for t in x_batch["text"].numpy()] == ["d e f", "c"]
    np.testing.assert_array_equal(y_batch.numpy(), [0, 1])


def test_fingerprints_differ_for_other_values_and_agree_for_equal_ones():
    a = Examples(({"t": np.array(["x", "y"])}, np.array([0, 1])))
    b = Examples(({"t": np.array(["x", "y"])}, np.array([0, 1])))
    c = Examples(({"t": np.array(["x", "z"])}, np.array([0, 1])))
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_streamed_epoch_reads_each_example_once_in_the_plans_local_batches(world_size):
    data = tf.data.Dataset.from_tensor_slices(({"id": np.arange(23)}, np.arange(23) % 2))
    streamed = StreamedExamples(data, None, shuffle_buffer=100, seed=3)
    seen = []
    for rank in range(world_size):
        plan = ShardPlan(23, 4, world_size, rank, seed=3)
        batches, sizes = streamed.train_batches(plan, epoch=1)
        got = [(x["id"].numpy(), y.numpy()) for x, y in batches]
        assert [len(ids) for ids, _ in got] == sizes and len(sizes) == plan.steps_per_epoch
        seen += [i for ids, _ in got for i in ids]
    assert sorted(seen) == list(range(23))


def test_variable_length_elements_are_padded_per_batch_in_the_given_sizes():
    data = tf.data.Dataset.from_tensor_slices(tf.ragged.constant([[1], [1, 2], [1, 2, 3], [1]]))
    batches = [b.numpy().tolist() for b in padded_batches(data, [3, 1])]
    assert batches == [[[1, 0, 0], [1, 2, 0], [1, 2, 3]], [[1]]]


def test_class_weights_follow_keras_rule_and_name_a_class_that_is_not_there():
    np.testing.assert_array_equal(class_weights(np.array([0, 1, 2, 1]), {1: 3.0}, "w"), [1, 3, 1, 3])
    np.testing.assert_array_equal(class_weights(np.eye(3)[[2, 0]], {2: 0.5}, "w"), [0.5, 1])
    with pytest.raises(HvdtrainError, match=r"class_weight names class\(es\) \[7\] that no training label holds"):
        class_weights(np.array([0, 1]), {7: 2.0}, "hvdtrain.fit(class_weight=...)")
    with pytest.raises(HvdtrainError, match="one label array"):
        class_weights({"a": np.array([0])}, {0: 1.0}, "w")


@pytest.mark.parametrize("kwargs, message", [
    (dict(x={"a": np.zeros((4, 2)), "b": np.zeros((3, 2))}, y=np.zeros(4)),
     r"different numbers of examples per part: x\['a'\] 4, x\['b'\] 3, y 4"),
    (dict(x={"a": np.zeros((4, 2))}, y=np.zeros(4), validation_data=({"b": np.zeros((2, 2))}, np.zeros(2))),
     r"the test data's structure differs .*x\['b'\] float64 \(2\).* against x\['a'\] float64 \(2\)"),
    (dict(x=np.zeros((4, 2)), y=np.zeros(4), sample_weight=np.ones(4), class_weight={0: 1.0}),
     "sample_weight or class_weight, not both"),
    (dict(x=np.array([[1, 2], [3]], dtype=object), y=np.zeros(2)), "rows of different lengths"),
])
def test_bad_data_is_one_error_naming_the_part(kwargs, message):
    with pytest.raises(HvdtrainError, match=message):
        examples_from(None, **kwargs)


def test_streamed_sets_must_share_one_structure_and_be_unbatched():
    train = tf.data.Dataset.from_tensor_slices(({"a": np.zeros((4, 2))}, np.zeros(4)))
    test = tf.data.Dataset.from_tensor_slices(({"b": np.zeros((4, 2))}, np.zeros(4)))
    with pytest.raises(HvdtrainError, match=r"the test set's elements differ"):
        StreamedExamples(train, test, 10, 0)
    with pytest.raises(HvdtrainError, match="the dataset is batched"):
        StreamedExamples(train.batch(2), None, 10, 0)
    with pytest.raises(HvdtrainError, match="infinite"):
        StreamedExamples(train.repeat(), None, 10, 0)


def test_a_data_function_is_called_once_per_split_where_the_rank_is_known():
    calls = []

    def make(split, rank, world_size, seed, epoch):
        calls.append((split, rank, world_size, seed, epoch))
        return tf.data.Dataset.from_tensor_slices(({"ids": np.zeros((5, 3), np.int32)}, np.zeros(5))) \
            if split == "train" else None

    deferred = examples_from(make, seed=7)
    assert not calls  # before the ranks are known, nothing is called
    examples = deferred(rank=1, world_size=2)
    assert calls == [("train", 1, 2, 7, 0), ("test", 1, 2, 7, 0)]
    assert (examples.num_train, examples.num_test) == (5, 0)
    assert examples.name == "hvdtrain.fit(data=make)"

    def fails(split, **_):
        raise KeyError(split)

    with pytest.raises(HvdtrainError, match=r"hvdtrain.fit\(data=fails\): the function raised KeyError: 'train' "
                                            r"\(split 'train'\)"):
        examples_from(fails)(rank=0, world_size=1)
