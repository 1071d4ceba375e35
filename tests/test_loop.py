"""hvdtrain.loop, the pieces of your own GradientTape loop: each rank's exact shard of each global
batch and its loss scale, global metric results from allreduced sums, rank-0 checkpoints restored
on every rank. examples/gan_loop.py (Horovod's DistributedGradientTape on Keras 3, two optimizers) at
2 ranks on local batch 8 equals one process on 16, on 101 images (the last step 3 + 2), its
per-epoch losses too; resumed from rank 0's checkpoint it continues bit for bit; a damaged
checkpoint stops every rank with its name."""
import json
import os

import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.data.sharding import ShardPlan
from hvdtrain.errors import HvdtrainError
from hvdtrain.loop import Checkpoints, global_results, rank_batches
from hvdtrain.runtime.dist import DistContext
from tests.helpers.kerases import needs_keras3
from tests.helpers.oracle import assert_same_weights
from tests.helpers.ranks import run_ranks

ALONE = DistContext(rank=0, local_rank=0, size=1, local_size=1, cross_size=1, device="/CPU:0", cpu_cores=(0,),
                    intra_op_threads=1)


def test_each_example_once_per_epoch_on_equal_steps_with_the_loss_weight_of_each():
    n, world = 101, 2
    data = {"ids": np.arange(n), "pair": (np.arange(n) * 2.0, tf.ragged.constant([[i] * (i % 3) for i in range(n)]))}
    batches = [list(rank_batches(data, ShardPlan(n, 8, world, r, seed=3), epoch=1)) for r in range(world)]
    assert len(batches[0]) == len(batches[1]) == 7
    seen = np.concatenate([b.examples["ids"] for rank in batches for b in rank])
    assert sorted(seen) == list(range(n))
    for rank in batches:
        for b in rank:  # every leaf's rows are the same examples
            np.testing.assert_array_equal(b.examples["pair"][0], b.examples["ids"] * 2.0)
            assert b.examples["pair"][1].nrows() == b.local_size
    last = [rank[-1] for rank in batches]
    assert [b.local_size for b in last] == [2, 3] and {b.global_size for b in last} == {5}
    assert [b.loss_weight for b in last] == [pytest.approx(0.8), pytest.approx(1.2)]
    assert {b.loss_weight for rank in batches for b in rank[:-1]} == {1.0}
    # The sum over ranks of local mean x loss_weight / world = the global batch's mean, on the short step too.
    values = [b.examples["pair"][0] for b in last]
    assert sum(v.mean() * b.loss_weight for v, b in zip(values, last)) / world == pytest.approx(
        np.concatenate(values).mean())


def test_a_leaf_of_another_length_and_fewer_examples_than_ranks_are_errors_at_the_call():
    with pytest.raises(ValueError, match=r"data\['labels'\] has 99 rows, the plan 101 examples"):
        rank_batches({"images": np.zeros((101, 2)), "labels": np.zeros(99)}, ShardPlan(101, 8, 1, 0), 0)
    with pytest.raises(ValueError, match="3 examples for 4 ranks: a rank's batch would be empty"):
        rank_batches(np.zeros(3), ShardPlan(3, 1, 4, 3), 0)


def test_the_last_few_examples_join_the_step_before_rather_than_leave_a_rank_empty():
    batches = [list(rank_batches(np.arange(33), ShardPlan(33, 8, 2, r), 0)) for r in range(2)]
    assert [b.global_size for b in batches[0]] == [16, 17] and [b.local_size for b in batches[1]] == [8, 9]
    assert sum(rank[-1].loss_weight for rank in batches) == pytest.approx(2)  # the weights average to 1


def test_global_results_of_no_metrics_and_of_two_of_one_name():
    import keras

    assert global_results(ALONE, []) == {}
    with pytest.raises(ValueError, match=r"metrics of one name: \['loss'\]"):
        global_results(ALONE, [keras.metrics.Mean(name="loss"), keras.metrics.Mean(name="loss")])


def test_global_results_are_the_metrics_results_and_leave_their_state():
    import keras

    mean, accuracy = keras.metrics.Mean(name="loss"), keras.metrics.SparseCategoricalAccuracy(name="accuracy")
    mean.update_state([1.0, 2.0, 6.0])
    accuracy.update_state([0, 1], [[0.9, 0.1], [0.8, 0.2]])
    assert global_results(ALONE, [mean, accuracy]) == {"loss": 3.0, "accuracy": 0.5}
    assert float(mean.result()) == 3.0 and float(mean.count.numpy()) == 3.0


@needs_keras3
def test_a_keras3_optimizer_not_built_is_refused(tmp_path):
    import keras

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(HvdtrainError, match=r"optimizer 'opt' is not built.*opt.build\(model.trainable_variables\)"):
        Checkpoints(ALONE, str(tmp_path), model=model, opt=keras.optimizers.Adam())


def _gan(out, np_, batch, epochs, ckpt, check=True):
    argv = ["examples/gan_loop.py", "--train", "101", "--batch-size", str(batch), "--epochs", str(epochs),
            "--ckpt-dir", str(ckpt), "--out", str(out)]
    return run_ranks(np_, argv, launcher="gloo" if np_ > 1 else "single", timeout=300, check=check)


def _result(out):
    return dict(np.load(f"{out}.npz")), json.loads(open(f"{out}.json").read())


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    base = tmp_path_factory.mktemp("gan_loop")
    result = _gan(base / "np2", 2, 8, 2, base / "ckpt")
    return base, result


@needs_keras3
def test_the_gan_loop_at_two_ranks_equals_one_process_on_the_global_batch(two_ranks, tmp_path):
    base, result = two_ranks
    assert "world size 2 x local batch 8 = global batch 16; 101 images, 7 steps per epoch" in result.stdout
    _gan(tmp_path / "np1", 1, 16, 2, tmp_path / "ckpt")
    (ours, ran), (theirs, alone) = _result(base / "np2"), _result(tmp_path / "np1")
    assert len(ours) == 8
    assert_same_weights(ours, theirs, prefix="")
    assert (ran["world_size"], alone["world_size"]) == (2, 1)
    for mine, one in zip(ran["history"], alone["history"], strict=True):  # global sums, not the ranks' means
        assert mine == pytest.approx(one, rel=1e-5)


@needs_keras3
def test_a_resumed_loop_continues_bit_for_bit_from_rank_0s_checkpoint(two_ranks, tmp_path):
    base, _ = two_ranks
    _gan(tmp_path / "first", 2, 8, 1, tmp_path / "ckpt")
    assert sorted(os.listdir(tmp_path / "ckpt"))[0] == "checkpoint"  # rank 0's alone: one set of files
    result = _gan(tmp_path / "resumed", 2, 8, 2, tmp_path / "ckpt")
    assert "from epoch 2" in result.stdout
    (resumed, ran), (straight, _) = _result(tmp_path / "resumed"), _result(base / "np2")
    assert ran["first_epoch"] == 1
    for key in straight:
        np.testing.assert_array_equal(resumed[key], straight[key], err_msg=key)


@needs_keras3
def test_a_damaged_checkpoint_stops_every_rank_naming_it(two_ranks, tmp_path):
    base, _ = two_ranks
    ckpt = base / "ckpt"
    data = [f for f in os.listdir(ckpt) if f.startswith("ckpt-2.data")]
    damaged = tmp_path / "ckpt"
    damaged.mkdir()
    for name in os.listdir(ckpt):
        content = (ckpt / name).read_bytes()
        (damaged / name).write_bytes(content[:len(content) // 2] if name in data else content)
    before = {name: (damaged / name).read_bytes() for name in os.listdir(damaged)}
    result = _gan(tmp_path / "again", 2, 8, 3, damaged, check=False)
    assert result.returncode != 0
    assert f"checkpoint {damaged}/ckpt-2 is corrupt or of other objects" in result.stdout + result.stderr
    # Rank 1 waits for rank 0 to print its error, then the launcher ends the job (within the timeout: no hang).
    assert "Terminating remaining workers" in result.stdout or "rank 0 failed while restoring" in result.stderr
    assert {name: (damaged / name).read_bytes() for name in os.listdir(damaged)} == before


@pytest.mark.parametrize("keras_version", [2, pytest.param(3, marks=needs_keras3)])
def test_checkpoints_hold_every_object_and_restore_the_newest(tmp_path, keras_version):
    """In one process, Keras 2's objects (an optimizer listing its variables by a method) and Keras 3's."""
    from hvdtrain import kerases

    keras = kerases.module(keras_version)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    optimizer.build(model.trainable_variables)
    step = tf.Variable(0, dtype=tf.int64)
    checkpoints = Checkpoints(ALONE, str(tmp_path), keep=2, model=model, optimizer=optimizer, step=step)
    assert checkpoints.restore() == 0  # none yet
    saved = []
    for number in (1, 2, 3):
        for v in model.weights:
            v.assign(tf.fill(v.shape, float(number)))
        step.assign(number)
        saved.append(checkpoints.save(number))
    assert sorted(p for p in os.listdir(tmp_path) if p.endswith(".index")) == ["ckpt-2.index", "ckpt-3.index"]
    for v in model.weights:
        v.assign(tf.zeros(v.shape))
    step.assign(0)
    again = Checkpoints(ALONE, str(tmp_path), model=model, optimizer=optimizer, step=step)
    assert again.restore() == 3 and int(step.numpy()) == 3
    assert all(np.all(v.numpy() == 3.0) for v in model.weights)


def test_a_damaged_index_is_an_error_not_a_silent_restart(tmp_path):
    step = tf.Variable(0, dtype=tf.int64)
    Checkpoints(ALONE, str(tmp_path), step=step).save(1)
    (tmp_path / "checkpoint").write_text("garbage {{{")
    with pytest.raises(HvdtrainError, match=r"checkpoints ckpt-1.index are in .*, but its 'checkpoint' index names none"):
        Checkpoints(ALONE, str(tmp_path), step=step).restore()


@needs_keras3
def test_each_rank_offsets_its_seed_generators_after_the_broadcast():
    import keras

    from hvdtrain.keras_step import offset_seed_generators

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dropout(0.5, seed=3)])
    state = [v for v in model.variables if "seed_generator_state" in v.path]
    assert len(state) == 1
    before = np.array(state[0].numpy())
    offset_seed_generators(model.variables, 0)  # rank 0 draws what one process draws
    np.testing.assert_array_equal(state[0].numpy(), before)
    offset_seed_generators(model.variables, 2)
    np.testing.assert_array_equal(state[0].numpy(), before + [2 * 1_000_003, 0])
