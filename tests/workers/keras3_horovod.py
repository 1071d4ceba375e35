"""Worker: hvd.DistributedOptimizer on a Keras 3 optimizer, used as Horovod's users use it (no hvdtrain
training loop): apply_gradients in a custom loop, Keras 3's own model.fit, backward_passes_per_step,
and a local variable. Each rank trains on other data; writes its weights to OUT/rank<r>.npz.

    python -m tests.workers.keras3_horovod OUT
"""
import os
import sys

import numpy as np
import tensorflow as tf

import hvdtrain  # noqa: F401 -- as a user's script would import it
import horovod.tensorflow as hvd
import keras

hvd.init()
out = sys.argv[1]
rng = np.random.default_rng(hvd.rank())  # each rank its own data: averaged gradients are the only link


def model_and_optimizer(**wrap):
    keras.utils.set_random_seed(hvd.rank())  # different initial weights: the broadcast must fix them
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])
    optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01), **wrap)
    for v in model.variables:
        v.assign(hvd.broadcast(v.value, root_rank=0))
    return model, optimizer


def batch():
    return rng.normal(size=(16, 4)).astype("float32"), rng.integers(0, 2, 16)


def loss_fn(model, x, y):
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True))


results = {}
for name, wrap, local in (("apply_gradients", {}, False), ("backward_passes_2", {"backward_passes_per_step": 2,
                                                                                "average_aggregated_gradients": True},
                                                             False), ("local_bias", {}, True)):
    model, optimizer = model_and_optimizer(**wrap)
    if local:
        optimizer.register_local_var(model.layers[-1].bias)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(model, x, y)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    for _ in range(4):
        step(*batch())
    results.update({f"{name}/{i}": v.numpy() for i, v in enumerate(model.trainable_variables)})
    results[f"{name}/iterations"] = np.array(int(optimizer.iterations.numpy()))

model, optimizer = model_and_optimizer()
model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
x, y = zip(*(batch() for _ in range(3)))
model.fit(np.concatenate(x), np.concatenate(y), batch_size=16, epochs=1, shuffle=False, verbose=0)
results.update({f"fit/{i}": v.numpy() for i, v in enumerate(model.trainable_variables)})
np.savez(os.path.join(out, f"rank{hvd.rank()}.npz"), **results)
