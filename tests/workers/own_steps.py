"""Keras model objects trained by hvdtrain.fit through their own step, one case after another in one
process (so fit runs again and again, and Horovod is used after it): the oracle of
tests/test_keras_step.py compares np=2 at local batch B with one process at 2B.

    python own_steps.py OUT_DIR KERAS BATCH CASE[,CASE...] [EPOCHS [resume]]   KERAS: 2 | 3

EPOCHS (default 2) is the run's total; ``resume`` continues the run in OUT_DIR/<case> from its
checkpoint, as a new process does after a stop. OWN_STEPS_FLOATX=float64 builds the models in float64.

Writes OUT_DIR/<case>.rank<r>.npz: the final trained weights (``final/<i>``), every weight
(``all/<i>``: Keras 2 counts a model's metric trackers among them) and, as JSON in
OUT_DIR/<case>.rank<r>.json, the history and what the run reports.
"""
import json
import os
import sys

import numpy as np
import tensorflow as tf

import hvdtrain  # noqa: E402

out, version, batch, cases = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")
epochs, resume = int((sys.argv[5:] or [2])[0]), sys.argv[6:] == ["resume"]
if version == 3:
    import keras as K  # noqa: N812
else:
    import tf_keras as K  # noqa: N812

if os.environ.get("OWN_STEPS_FLOATX"):  # float64: the oracle's decisive precision
    K.backend.set_floatx(os.environ["OWN_STEPS_FLOATX"])
hvdtrain.init_distributed()
# 101 / (2 x 8): six full global batches and a short last one of 5, 3 + 2: each rank traces its own
# last step. (97: the last example joins the step before, 9 + 8: one rank traces anew, the other not.)
N = int(os.environ.get("OWN_STEPS_EXAMPLES", "101"))
rng = np.random.default_rng(7)
NUM = rng.normal(size=(N, 6)).astype(np.float32)
IDS = rng.integers(1, 40, (N, 7)).astype(np.int32)
CLS = (NUM[:, 0] + (IDS[:, 0] % 3) > 0.5).astype(np.int32) + (NUM[:, 1] > 1.0).astype(np.int32)
REG = (NUM[:, :1] * 0.5 + 0.1).astype(np.float32)
WEIGHT = rng.uniform(0.2, 2.0, N).astype(np.float32)
if os.environ.get("OWN_STEPS_FLOATX"):  # the data of a float64 model: its own train_step subtracts it
    NUM, REG, WEIGHT = (a.astype(os.environ["OWN_STEPS_FLOATX"]) for a in (NUM, REG, WEIGHT))


def two_headed():
    num, ids = K.Input((6,), name="num"), K.Input((7,), dtype="int32", name="ids")
    # 400 rows, ids below 40: allgathering the rows a step touched is cheaper than the table's allreduce.
    text = K.layers.GlobalAveragePooling1D()(K.layers.Embedding(400, 4)(ids))
    h = K.layers.Dense(8, activation="tanh")(K.layers.Concatenate()([num, text]))
    return K.Model({"num": num, "ids": ids}, {"cls": K.layers.Dense(3, name="cls")(h),
                                              "reg": K.layers.Dense(1, name="reg")(h)})


class OwnStep(K.Model):
    """A subclassed model with its own train_step: mean absolute error, its own tracker."""

    def __init__(self):
        super().__init__()
        self.body = K.Sequential([K.layers.Dense(8, activation="tanh"), K.layers.Dense(1)])
        self.tracker = K.metrics.Mean(name="mae")

    def call(self, x, training=False):
        return self.body(x, training=training)

    @property
    def metrics(self):
        return [self.tracker]

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.abs(self(x, training=True) - y))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        self.tracker.update_state(loss, sample_weight=tf.shape(y)[0])
        return {"mae": self.tracker.result()}


class TwoOptimizers(K.Model):
    """A GAN's shape without its randomness: two sub-models, each stepped by its own optimizer."""

    def __init__(self):
        super().__init__()
        self.first = K.Sequential([K.layers.Dense(4, activation="tanh")])
        self.second = K.Sequential([K.layers.Dense(1)])
        self.first_tracker, self.second_tracker = K.metrics.Mean(name="first"), K.metrics.Mean(name="second")

    def call(self, x, training=False):
        return self.second(self.first(x, training=training), training=training)

    @property
    def metrics(self):
        return [self.first_tracker, self.second_tracker]

    def compile(self, first_optimizer, second_optimizer):
        super().compile()
        self.first_optimizer, self.second_optimizer = first_optimizer, second_optimizer

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            first = tf.reduce_mean(tf.square(self(x, training=True) - y))
        grads = tape.gradient(first, self.first.trainable_variables)
        self.first_optimizer.apply_gradients(zip(grads, self.first.trainable_variables))
        with tf.GradientTape() as tape:
            second = tf.reduce_mean(tf.abs(self(x, training=True) - y))
        grads = tape.gradient(second, self.second.trainable_variables)
        self.second_optimizer.apply_gradients(zip(grads, self.second.trainable_variables))
        self.first_tracker.update_state(first, sample_weight=tf.shape(y)[0])
        self.second_tracker.update_state(second, sample_weight=tf.shape(y)[0])
        return {"first": self.first_tracker.result(), "second": self.second_tracker.result()}


def sgd():
    return K.optimizers.SGD(0.1, momentum=0.9)


def case(name):
    """``(model, fit's arguments)`` of one case."""
    xent = K.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y = {"num": NUM, "ids": IDS}, {"cls": CLS, "reg": REG}
    if name == "dict-two-outputs":  # dict inputs, token ids, two outputs with loss weights, compiled by the user
        model = two_headed()
        model.compile(sgd(), loss={"cls": xent, "reg": "mse"}, loss_weights={"cls": 1.0, "reg": 0.5},
                      metrics={"cls": ["accuracy"]})
        return model, dict(x=x, y=y, validation_data=(x, y))
    if name == "sample-weights":  # (x, y, sample_weight), compiled by fit
        model = two_headed()
        return model, dict(x=x, y=y, sample_weight=WEIGHT, optimizer=sgd(), loss={"cls": xent, "reg": "mse"})
    if name == "class-weights":
        inputs = K.Input((7,), dtype="int32")
        h = K.layers.GlobalAveragePooling1D()(K.layers.Embedding(40, 6)(inputs))
        model = K.Model(inputs, K.layers.Dense(3)(h))
        return model, dict(x=IDS, y=CLS, class_weight={0: 0.5, 1: 2.0, 2: 1.0}, optimizer=sgd(), loss=xent,
                           metrics=["accuracy"])
    if name == "streamed":  # tf.data of (x, y, sample_weight) triples
        model = two_headed()
        model.compile(sgd(), loss={"cls": xent, "reg": "mse"}, loss_weights={"cls": 1.0, "reg": 0.5})
        train = tf.data.Dataset.from_tensor_slices((x, y, WEIGHT))
        return model, dict(data=(train, None))
    if name == "own-train-step":
        model = OwnStep()
        model.compile(optimizer=sgd())
        return model, dict(x=NUM, y=REG)
    if name == "two-optimizers":
        model = TwoOptimizers()
        model.compile(sgd(), K.optimizers.SGD(0.05, momentum=0.5))  # both with state a resume must restore
        return model, dict(x=NUM, y=REG)
    raise SystemExit(f"unknown case {name}")


for name in cases:
    K.utils.set_random_seed(0)  # the same initial weights at any world size
    model, kwargs = case(name)
    data = kwargs.pop("data", None)
    result = hvdtrain.fit(model, data, epochs=epochs, batch_size=batch, log={"dir": os.path.join(out, name)},
                          checkpoint={"resume": resume}, **kwargs)
    import horovod.tensorflow as hvd  # usable after fit

    rank = hvd.rank()
    np.savez(os.path.join(out, f"{name}.rank{rank}.npz"),
             **{f"final/{i}": w.numpy() for i, w in enumerate(result.model.trainable_weights)},
             **{f"all/{i}": w for i, w in enumerate(result.model.get_weights())})
    with open(os.path.join(out, f"{name}.rank{rank}.json"), "w") as f:
        json.dump({"history": result.history, "world_size": hvd.size()}, f)
