"""Worker: Horovod's own TF2 API on Keras 3 objects (``import keras``), each behaviour that Horovod's
``test/parallel/test_tensorflow2_keras.py`` (0.28.1) checks, in its Keras 3 meaning, plus the pieces of a
GradientTape loop: ``broadcast_variables`` of a model's and an optimizer's variables,
``DistributedGradientTape`` (with a local source), ``PartialDistributedOptimizer``, the Keras callbacks
(broadcast with local variables, metric average, learning-rate warmup and schedule) and elastic
``KerasState``. Each rank writes OUT/rank<r>.json: {case: "ok" or the error}.

    python -m tests.workers.horovod_keras3_api OUT [hvdtrain-first]

With ``hvdtrain-first`` the script imports hvdtrain before TensorFlow, as a user's script of hvdtrain's
loop helpers does (tf.keras is then Keras 2; ``import keras`` is still Keras 3).
"""
import json
import os
import sys
import traceback

if "hvdtrain-first" in sys.argv[2:]:
    import hvdtrain  # noqa: F401

import numpy as np
import tensorflow as tf
import keras

import horovod.tensorflow as hvd
import horovod.keras
import horovod.tensorflow.keras as hvd_keras

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
if RANK == 0:
    print(f"tf.keras is Keras {2 if tf.keras.__name__.startswith('tf_keras') else 3}", flush=True)
CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def dense_model(value, units=(2,), input_dim=3):
    """A Sequential of Dense layers, every weight ``value`` (each rank its own)."""
    init = keras.initializers.Constant(value)
    layers = [keras.Input((input_dim,))]
    layers += [keras.layers.Dense(u, kernel_initializer=init, bias_initializer=init) for u in units]
    return keras.Sequential(layers)


def assert_close(a, b, msg=""):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6, err_msg=msg)


@case
def broadcast_variables_of_a_model_and_its_optimizer():
    model = dense_model(float(RANK), units=(4, 2))
    optimizer = keras.optimizers.Adam(0.1)
    optimizer.build(model.trainable_variables)
    for v in optimizer.variables:
        v.assign(tf.fill(v.shape, tf.cast(RANK + 1, v.dtype)))
    hvd.broadcast_variables(model.variables, root_rank=0)
    hvd.broadcast_variables(optimizer.variables, root_rank=0)
    for v in model.variables:
        assert_close(v, np.zeros(v.shape), v.path)
    for v in optimizer.variables:
        assert_close(v, np.ones(v.shape), v.path)
    # In a tf.function too (a loop's first step), and in place.
    model2 = dense_model(float(RANK))
    @tf.function
    def broadcast():
        hvd.broadcast_variables(model2.variables, root_rank=SIZE - 1)

    broadcast()
    hvd.broadcast_variables(model2.variables, root_rank=0, inplace=True)
    for v in model2.variables:
        assert_close(v, np.full(v.shape, SIZE - 1.0), v.path)


@case
def distributed_gradient_tape_averages_and_keeps_local_sources():
    model = dense_model(1.0)
    x = np.full((4, 3), RANK + 1.0, np.float32)

    @tf.function
    def grads():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        tape = hvd.DistributedGradientTape(tape)
        tape.register_local_source(model.layers[0].bias)
        return tape.gradient(loss, model.trainable_variables)

    kernel, bias = grads()
    # d/dW sum(xW + b) = sum over rows of x: 4 (rank + 1) per entry; averaged over ranks.
    mean = np.mean([4.0 * (r + 1) for r in range(SIZE)])
    assert_close(kernel, np.full((3, 2), mean), "kernel: averaged")
    assert_close(bias, np.full((2,), 4.0 / SIZE), "bias: local, scaled by 1/size")
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x))
    tape = hvd.DistributedGradientTape(tape)
    tape.register_local_source(model.layers[0].bias)
    local, shared = tape.get_local_and_global_gradients(loss, model.trainable_variables)
    assert [v.name for v, _ in local] == ["bias"] and [v.name for v, _ in shared] == ["kernel"]


@case
def gradient_tape_loop_with_a_distributed_optimizer():
    """A GAN-style loop's step: the tape's gradients through hvd.DistributedOptimizer's apply_gradients."""
    model = dense_model(float(RANK))
    optimizer = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(1.0))
    hvd.broadcast_variables(model.variables, root_rank=0)
    x = np.full((2, 3), RANK + 1.0, np.float32)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    step()
    mean = np.mean([2.0 * (r + 1) for r in range(SIZE)])
    assert_close(model.layers[0].kernel, np.full((3, 2), -mean))
    assert_close(model.layers[0].bias, np.full((2,), -2.0))


@case
def train_model_lr_schedule():
    initial_lr = 0.1 * SIZE
    optimizer = hvd_keras.DistributedOptimizer(keras.optimizers.Adam())
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.RepeatVector(3)])
    model.compile(loss="mse", optimizer=optimizer, metrics=["categorical_accuracy"])
    rng = np.random.default_rng(RANK)
    x, y = rng.random((10, 3)), rng.random((10, 3, 2))
    seen = {}

    class StoreLearningRate(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen[epoch] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))

    def linear_multiplier(epoch):
        return epoch

    callbacks = [
        hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd_keras.callbacks.MetricAverageCallback(),
        hvd_keras.callbacks.LearningRateWarmupCallback(initial_lr=initial_lr, warmup_epochs=5),
        hvd_keras.callbacks.LearningRateScheduleCallback(initial_lr=initial_lr, multiplier=1e-1, start_epoch=5,
                                                         end_epoch=10),
        hvd_keras.callbacks.LearningRateScheduleCallback(initial_lr=initial_lr, multiplier=1e-2, start_epoch=10,
                                                         end_epoch=15),
        hvd_keras.callbacks.LearningRateScheduleCallback(initial_lr=initial_lr, multiplier=linear_multiplier,
                                                         start_epoch=15, end_epoch=20),
        StoreLearningRate()]
    history = model.fit(x, y, batch_size=2, steps_per_epoch=5, callbacks=callbacks, epochs=20, verbose=0)
    for epoch, lr in seen.items():  # at each epoch's end, after its last batch of 5
        if epoch < 5:  # warmup: from initial_lr / size up to initial_lr, batch by batch
            expected = initial_lr / SIZE * ((epoch + 1) * (SIZE - 1) / 5 + 1)
        elif epoch < 10:  # a constant multiplier decays exponentially, per epoch
            expected = initial_lr * 1e-1 ** (epoch - 5)
        elif epoch < 15:
            expected = initial_lr * 1e-2 ** (epoch - 10)
        else:
            expected = initial_lr * linear_multiplier(epoch)
        assert np.isclose(lr, expected, rtol=1e-5), (epoch, lr, expected)
    assert np.isclose(history.history["lr"][-1], seen[19])
    loss = tf.constant(history.history["loss"], tf.float32)  # averaged over ranks: rank 0's everywhere
    assert_close(loss, hvd.broadcast(loss, root_rank=0))


@case
def sparse_as_dense():
    optimizer = hvd_keras.DistributedOptimizer(keras.optimizers.RMSprop(1e-4), sparse_as_dense=True)
    model = keras.Sequential([keras.Input((10,), dtype="int32"), keras.layers.Embedding(1000, 64)])
    model.compile(loss="mse", optimizer=optimizer)
    hvd.broadcast_variables(model.variables, root_rank=0)
    rng = np.random.default_rng(RANK)
    model.train_on_batch(rng.integers(1000, size=(32, 10)), rng.random((32, 10, 64)))
    table = tf.constant(model.layers[0].embeddings.numpy())
    assert_close(table, hvd.broadcast(table, root_rank=0))


@case
def sparse_as_dense_with_grad_aggregation():
    passes = 2
    optimizer = hvd_keras.DistributedOptimizer(keras.optimizers.RMSprop(1e-4), sparse_as_dense=True,
                                               backward_passes_per_step=passes)
    model = keras.Sequential([keras.Input((10,), dtype="int32"), keras.layers.Embedding(1000, 64)])
    model.compile(loss="mse", optimizer=optimizer)
    rng = np.random.default_rng(RANK)
    for _ in range(3):
        model.train_on_batch(rng.integers(1000, size=(32, 10)), rng.random((32, 10, 64)))
    assert int(optimizer._agg_helper.counter.numpy()) == 3 % passes


@case
def grad_aggregation_with_inf_grad():
    passes = 2
    step_count = tf.Variable(0, trainable=False, dtype=tf.int32)
    optimizer = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(), backward_passes_per_step=passes,
                                               sparse_as_dense=True)
    x = keras.Variable(0.0)

    def loss():
        step_count.assign_add(1)
        return tf.cond(tf.greater(step_count, 1), lambda: x.value, lambda: x.value * float("inf"))

    for _ in range(2 * passes):
        # The first cycle's infinite gradient is zeroed after its update and leaves the second finite.
        with tf.GradientTape() as tape:
            value = loss()
        grads = tape.gradient(value, [x])
        optimizer.apply_gradients(zip(grads, [x]))
    assert tf.math.is_finite(grads[0])


@case
def from_config():
    optimizer = hvd_keras.DistributedOptimizer(keras.optimizers.Adam())
    config = optimizer.get_config()
    assert optimizer.from_config(config).get_config() == config
    assert optimizer.__class__.from_config(config).get_config() == config


@case
def elastic_state():
    v = 1.0 if RANK == 0 else 2.0
    model1 = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, activation="softmax")])
    model1.set_weights([np.full((2, 2), v, np.float32), np.full((2,), v, np.float32)])
    model2_weights = [np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), np.zeros(2, np.float32)]
    optimizer = keras.optimizers.Adam(0.001 * SIZE)
    state = hvd_keras.elastic.KerasState(model1, optimizer, batch=20 + RANK, epoch=10 + RANK)
    state.sync()
    synced = model1.get_weights()
    for w in state.model.get_weights():  # rank 0's everywhere
        assert_close(w, np.ones_like(w))
    assert (state.batch, state.epoch) == (20, 10)
    model1.set_weights(model2_weights)
    state.batch, state.epoch = 21, 11
    state.restore()
    for w1, w2 in zip(model1.get_weights(), synced):
        assert_close(w1, w2)
    assert (state.batch, state.epoch) == (20, 10)
    model1.set_weights(model2_weights)
    state.batch, state.epoch = 21, 11
    state.commit()
    state.restore()
    for w1, w2 in zip(model1.get_weights(), model2_weights):
        assert_close(w1, w2)
    assert (state.batch, state.epoch) == (21, 11)


class AddGradient(keras.optimizers.Optimizer):
    """Adds each gradient to its variable: the updates show exactly what was aggregated."""

    def __init__(self, learning_rate=1.0, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)

    def update_step(self, gradient, variable, learning_rate):
        self.assign_add(variable, gradient)


def _gradient_aggregation(average, local):
    passes, steps = 4, 10
    optimizer = hvd_keras.DistributedOptimizer(AddGradient(name="add"), backward_passes_per_step=passes,
                                               average_aggregated_gradients=average, sparse_as_dense=True)
    n = 8 if local else 1
    xs = [keras.Variable([0.0], name=f"x{i}") for i in range(n)]
    ys = [keras.Variable([1.0, 2.0], name=f"y{i}") for i in range(n)]
    local_count = n // 2 if local else 0
    for i in range(local_count):
        optimizer.register_local_var(xs[i])
        optimizer.register_local_var(ys[i])
    variables = xs + ys
    scale = float(RANK + 1) if local else 1.0

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(x - scale * tf.gather(y, [0])) for x, y in zip(xs, ys)])
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))

    for idx in range(steps):
        step()
        cycles = (idx + 1) // passes
        factor = 1.0 if average else float(passes)
        mean_scale = (SIZE + 1) / 2.0 if local else 1.0
        for i in range(n):
            is_local = i < local_count
            gx = cycles * factor / (SIZE if is_local else 1)
            gy = -cycles * factor * (scale / SIZE if is_local else mean_scale)
            assert_close(xs[i], [gx], f"x{i} at step {idx}")
            assert_close(ys[i], [1.0 + gy, 2.0], f"y{i} at step {idx}")
        assert int(optimizer.iterations.numpy()) == idx + 1
    assert int(optimizer._agg_helper.counter.numpy()) == steps % passes


@case
def gradient_aggregation_averaged():
    _gradient_aggregation(True, local=False)


@case
def gradient_aggregation_summed():
    _gradient_aggregation(False, local=False)


@case
def gradient_aggregation_with_local_vars_averaged():
    _gradient_aggregation(True, local=True)


@case
def gradient_aggregation_with_local_vars_summed():
    _gradient_aggregation(False, local=True)


@case
def partial_distributed_optimizer():
    for num_local_layers in range(3):
        init = keras.initializers.Constant(float(RANK))
        model = keras.Sequential([
            keras.Input((3,)), keras.layers.Dense(2, kernel_initializer=init, bias_initializer=init),
            keras.layers.RepeatVector(3),
            keras.layers.TimeDistributed(keras.layers.Dense(3, kernel_initializer=init, bias_initializer=init))])
        x, y = np.random.default_rng(RANK).random((1, 3)), np.random.default_rng(RANK).random((1, 3, 3))
        local_layers = model.layers[:num_local_layers]
        optimizer = horovod.keras.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), sparse_as_dense=True,
                                                          local_layers=local_layers)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.mean_squared_error(y, model(x, training=True)))
        own = tape.gradient(loss, model.trainable_variables)
        before = [v.numpy() for v in model.trainable_variables]
        optimizer.apply_gradients(zip(own, model.trainable_variables))
        local = {id(v) for layer in local_layers for v in layer.trainable_weights}
        for v, grad, was in zip(model.trainable_variables, own, before):
            applied = was - v.numpy()  # SGD at rate 1: the gradient it applied
            if id(v) in local:  # kept on this rank, scaled by 1/size
                assert_close(applied * SIZE, grad, f"{num_local_layers} local: {v.path}")
            else:  # averaged: the ranks' weights differ, so their gradients do too
                assert not np.allclose(applied, grad.numpy()), f"{num_local_layers} local: {v.path}"
                assert_close(tf.constant(applied), hvd.broadcast(tf.constant(applied), root_rank=0), v.path)


@case
def broadcast_global_variables_callback_with_local_vars():
    root_rank = SIZE - 1
    init = keras.initializers.Constant(float(RANK))
    model = keras.Sequential(
        [keras.Input((3,))]
        + [keras.layers.Dense(3, kernel_initializer=init, bias_initializer=init, trainable=False) for _ in range(4)]
        + [keras.layers.RepeatVector(3),
           keras.layers.Dense(3, kernel_initializer=init, bias_initializer=init, trainable=False)])
    model.compile(loss="mse", metrics=["categorical_accuracy"], optimizer=keras.optimizers.SGD())
    local_variables = list(model.layers[0].variables)
    callback = hvd_keras.callbacks.BroadcastGlobalVariablesCallback(root_rank=root_rank,
                                                                    local_variables=local_variables)
    model.fit(np.random.random((1, 3)), np.random.random((1, 3, 3)), callbacks=[callback], verbose=0)
    local = {id(v) for v in local_variables}
    for v in model.variables:
        expected = float(RANK) if id(v) in local else float(root_rank)
        assert_close(v, np.full(v.shape, expected), v.path)


results = {}
for name, fn in CASES.items():
    try:
        fn()
        results[name] = "ok"
    except Exception as e:  # noqa: BLE001 -- each case reports its own failure
        results[name] = "".join(traceback.format_exception_only(e)).strip()[-2000:]
        traceback.print_exc()
with open(os.path.join(sys.argv[1], f"rank{RANK}.json"), "w") as f:
    json.dump(results, f, indent=1)
