"""Bad input to hvdtrain.fit for a Keras model object, at real ranks: every rank exits non-zero with
one error naming the problem (tests/test_keras_step.py).

    python own_step_errors.py OUT_DIR MODE   MODE: label-key | loss-key | rank-data | ragged | class-weight | no-loss
"""
import sys

import keras
import numpy as np
import tensorflow as tf

import hvdtrain

out, mode = sys.argv[1], sys.argv[2]
ctx = hvdtrain.init_distributed()
x = {"num": np.ones((40, 3), np.float32), "ids": np.ones((40, 4), np.int32)}
y = {"cls": np.zeros(40, np.int32), "reg": np.zeros((40, 1), np.float32)}
num, ids = keras.Input((3,), name="num"), keras.Input((4,), dtype="int32", name="ids")
h = keras.layers.Concatenate()([num, keras.layers.Flatten()(keras.layers.Embedding(5, 2)(ids))])
model = keras.Model({"num": num, "ids": ids}, {"cls": keras.layers.Dense(2, name="cls")(h),
                                               "reg": keras.layers.Dense(1, name="reg")(h)})
losses = {"cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "reg": "mse"}
kwargs = {}
if mode == "label-key":  # labels for an output the model does not have
    y = {"cls": y["cls"], "score": y["reg"]}
elif mode == "loss-key":
    losses = {**losses, "score": "mse"}
elif mode == "rank-data":  # rank 1 holds other values
    x["num"] = x["num"] * (1 + ctx.rank)
elif mode == "ragged":  # rows of 1-3 token ids, padded per batch to at most 3, for a model of 4
    x["ids"] = tf.ragged.constant([[1] * (1 + i % 3) for i in range(40)], dtype=tf.int32)
elif mode == "class-weight":
    y, losses = y["cls"], losses["cls"]
    model = keras.Model({"num": num, "ids": ids}, keras.layers.Dense(2)(h))
    kwargs = {"class_weight": {0: 1.0, 5: 2.0}}
if mode != "no-loss":  # an uncompiled model, and fit gets no loss
    model.compile("sgd", loss=losses)
hvdtrain.fit(model, x=x, y=y, epochs=1, batch_size=8, log={"dir": out}, **kwargs)
