"""A recommender on tabular features through hvdtrain.fit: dict inputs, embeddings, two heads.

    horovodrun -np 2 python examples/recommender.py

Each example is a user, an item and two float features; the model predicts the rating (mse) and
whether the user clicked (binary cross-entropy), with loss_weights. The data are generated (no
download) from hidden user and item factors, so a model that learns the embeddings does better
than one that does not. hvdtrain shards the examples exactly; every global metric, each head's
too, is exact over the ranks.
"""
import argparse

import keras
import numpy as np

import hvdtrain

p = argparse.ArgumentParser()
p.add_argument("--train", type=int, default=20000)
p.add_argument("--test", type=int, default=4000)
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--log-dir", default=None)
a = p.parse_args()
USERS, ITEMS = 200, 300


def interactions(n: int, seed: int):
    """``(features, labels)``: dicts of ``n`` rows, from fixed hidden factors (seed 0)."""
    factors = np.random.default_rng(0)
    users, items = factors.normal(size=(USERS, 4)), factors.normal(size=(ITEMS, 4))
    rng = np.random.default_rng(seed)
    user, item = rng.integers(0, USERS, n), rng.integers(0, ITEMS, n)
    price, hour = rng.uniform(0, 1, n).astype(np.float32), rng.uniform(0, 1, n).astype(np.float32)
    affinity = (users[user] * items[item]).sum(1) - price
    features = {"user": user.astype(np.int32), "item": item.astype(np.int32), "price": price[:, None],
                "hour": hour[:, None]}
    labels = {"rating": (3 + affinity).astype(np.float32)[:, None],
              "click": (affinity + rng.normal(0, 0.5, n) > 0).astype(np.float32)[:, None]}
    return features, labels


def recommender() -> keras.Model:
    inputs = {"user": keras.Input((), dtype="int32", name="user"), "item": keras.Input((), dtype="int32", name="item"),
              "price": keras.Input((1,), name="price"), "hour": keras.Input((1,), name="hour")}
    user = keras.layers.Embedding(USERS, 8)(inputs["user"])
    item = keras.layers.Embedding(ITEMS, 8)(inputs["item"])
    h = keras.layers.Concatenate()([user, item, user * item, inputs["price"], inputs["hour"]])
    h = keras.layers.Dense(32, activation="relu")(h)
    return keras.Model(inputs, {"rating": keras.layers.Dense(1, name="rating")(h),
                                "click": keras.layers.Dense(1, name="click")(h)})


hvdtrain.init_distributed()  # first: each rank pins its own GPU before TensorFlow starts
keras.utils.set_random_seed(0)  # the same run every time (rank 0's initial weights are broadcast)
x, y = interactions(a.train, 1)
test_x, test_y = interactions(a.test, 2)
model = recommender()
model.compile(keras.optimizers.Adam(3e-3),
              loss={"rating": "mse", "click": keras.losses.BinaryCrossentropy(from_logits=True)},
              loss_weights={"rating": 1.0, "click": 0.5},
              metrics={"rating": ["mae"], "click": [keras.metrics.BinaryAccuracy(threshold=0.0, name="accuracy")]})
result = hvdtrain.fit(model, x=x, y=y, validation_data=(test_x, test_y), epochs=a.epochs, batch_size=128,
                      log={"dir": a.log_dir, "progress": False})
if result.is_chief:
    last = result.history[-1]
    print(f"test rating mae {last['test_rating_mae']:.4f}, test click accuracy {last['test_click_accuracy']:.4f}")
