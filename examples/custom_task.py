"""Your own model, data, loss and metric through hvdtrain.fit: multi-label tags of Fashion-MNIST.

    horovodrun -np 2 python examples/custom_task.py

Each image gets 3 yes/no tags (footwear? a top? a bag?): sigmoid outputs with binary
cross-entropy. The model function uses hvdtrain.keras2.SyncBatchNormalization (tf.keras is Keras 2 here); the custom metric is any
function of labels and outputs giving one value per example, averaged exactly over all ranks.
"""
import argparse

import numpy as np
import tensorflow as tf

import hvdtrain
from hvdtrain.data.in_memory import load_idx_dir

p = argparse.ArgumentParser()
p.add_argument("--train", type=int, default=20000)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--log-dir", default=None)
a = p.parse_args()

FOOTWEAR, TOPS, BAGS = (5, 7, 9), (0, 2, 4, 6), (8,)  # Fashion-MNIST's class indices


def tags(classes):
    """(n,) classes -> (n, 3) float32 tags."""
    return np.stack([np.isin(classes, group) for group in (FOOTWEAR, TOPS, BAGS)], 1).astype(np.float32)


def small_cnn(input_shape, num_classes):
    """Called by hvdtrain with the data's image shape and K = 3 outputs (the tags' last axis)."""
    inputs = tf.keras.Input(input_shape)
    x = tf.keras.layers.Conv2D(16, 3, padding="same", use_bias=False)(inputs)
    x = hvdtrain.keras2.SyncBatchNormalization(activation="relu")(x)  # statistics of the global batch
    x = tf.keras.layers.MaxPool2D()(x)
    x = tf.keras.layers.Flatten()(x)
    return tf.keras.Model(inputs, tf.keras.layers.Dense(num_classes)(x))


def exact_match(labels, logits):
    """1 where every tag of the example is right, else 0 (one value per example)."""
    return tf.cast(tf.reduce_all(tf.equal(logits > 0, labels > 0.5), axis=-1), tf.float32)


fashion = load_idx_dir("/usr/share/datasets/fashion-mnist")
data = (fashion.x_train[:a.train], tags(fashion.y_train[:a.train]), fashion.x_test, tags(fashion.y_test))
result = hvdtrain.fit(small_cnn, data, loss="binary_crossentropy", metrics=["accuracy", exact_match],
                      epochs=a.epochs, batch_size=64, log={"dir": a.log_dir, "progress": False})
if result.is_chief:  # every rank holds the same global history: rank 0 prints it
    for epoch, metrics in enumerate(result.history, 1):
        print(f"epoch {epoch}: test tag accuracy {metrics['test_accuracy']:.4f}, "
              f"all tags right {metrics['test_exact_match']:.4f}")
