"""The built-in models' seeded dropout: masks keyed by (seed, rank, call count)."""
import numpy as np
import tensorflow as tf

from hvdtrain.models import SeededDropout, set_dropout_rank, seed_cnn


def _dropout_model(rank: int):
    layer = SeededDropout(0.5, seed=3, rank=rank)
    return tf.keras.Sequential([tf.keras.Input((64,)), layer]), layer


def _nth_call(rank: int, n: int, x):
    """The output of call ``n`` of a fresh dropout model of ``rank``: that rank's n-th mask."""
    model, _ = _dropout_model(rank)
    for _ in range(n - 1):
        model(x, training=True)
    return model(x, training=True).numpy()


def test_set_dropout_rank_rekeys_the_masks_at_the_next_trace():
    """After an elastic reset renumbers the ranks, a worker draws the masks of its new rank."""
    x = tf.ones([8, 64])
    model, layer = _dropout_model(rank=0)
    as_rank_0 = model(x, training=True).numpy()  # call 1, rank 0's stream
    set_dropout_rank(model, 1)
    step = tf.function(lambda t: model(t, training=True))  # a new trace, as after every reset
    after = step(x).numpy()  # call 2, now rank 1's stream
    assert layer.rank == 1 and layer.get_config()["rank"] == 1
    np.testing.assert_array_equal(after, _nth_call(rank=1, n=2, x=x))
    assert not np.array_equal(after, _nth_call(rank=0, n=2, x=x))
    assert not np.array_equal(as_rank_0, after)


def test_a_step_traced_before_keeps_the_old_rank():
    """Why hvdtrain traces a new step after every reset: the rank is fixed into the trace."""
    x = tf.ones([8, 64])
    model, _ = _dropout_model(rank=0)
    old_step = tf.function(lambda t: model(t, training=True))
    old_step(x)  # traced with rank 0
    set_dropout_rank(model, 1)
    np.testing.assert_array_equal(old_step(x).numpy(), _nth_call(rank=0, n=2, x=x))


def test_set_dropout_rank_reaches_nested_models_and_only_seeded_dropout():
    inner, _ = _dropout_model(rank=0)
    inputs = tf.keras.Input((64,))
    outer = tf.keras.Model(inputs, tf.keras.layers.Dense(3)(inner(inputs)))
    set_dropout_rank(outer, 4)
    assert [m.rank for m in outer.submodules if isinstance(m, SeededDropout)] == [4]
    cnn = seed_cnn((28, 28, 1), 10, rank=0)
    config_before = {m.name: m.get_config() for m in cnn.layers if not isinstance(m, SeededDropout)}
    set_dropout_rank(cnn, 5)
    dropouts = [m for m in cnn.submodules if isinstance(m, SeededDropout)]
    assert dropouts and all(d.rank == 5 for d in dropouts)
    assert {m.name: m.get_config() for m in cnn.layers if not isinstance(m, SeededDropout)} == config_before
