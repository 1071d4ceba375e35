"""A text classifier through hvdtrain.fit: a small Transformer encoder on variable-length token ids,
or on raw strings vectorized in the model by TextVectorization.

    horovodrun -np 2 python examples/text_classifier.py            # token ids, ragged rows
    horovodrun -np 2 python examples/text_classifier.py --strings  # raw strings

The texts are product reviews made from Fashion-MNIST's ten class names and sentiment words (no
download): the label is the review's sentiment, which a word anywhere in it decides. hvdtrain pads
each batch to its longest review (mask_zero), shards the reviews exactly, and sums the ranks'
count-weighted gradients before Adam's update.
"""
import argparse

import keras
import numpy as np
import tensorflow as tf

import hvdtrain

p = argparse.ArgumentParser()
p.add_argument("--train", type=int, default=4000)
p.add_argument("--test", type=int, default=1000)
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--strings", action="store_true", help="raw strings through TextVectorization")
p.add_argument("--log-dir", default=None)
a = p.parse_args()

GARMENTS = ["t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot"]
GOOD, BAD = ["great", "lovely", "comfortable", "perfect", "soft"], ["awful", "cheap", "torn", "scratchy", "tiny"]
FILLER = ["the", "this", "it", "is", "was", "fits", "and", "my", "really", "color", "size", "after", "washing"]


def reviews(n: int, seed: int):
    """``n`` reviews of 4-24 words and their sentiment (1: good), the same on every rank."""
    rng = np.random.default_rng(seed)
    texts, labels = [], rng.integers(0, 2, n)
    for label in labels:
        words = list(rng.choice(FILLER, rng.integers(3, 22))) + [rng.choice(GARMENTS)]
        words.insert(rng.integers(0, len(words) + 1), rng.choice(GOOD if label else BAD))
        texts.append(" ".join(words))
    return np.array(texts), labels.astype(np.int32)


class Encoder(keras.layers.Layer):
    """One Transformer encoder block (Vaswani et al. 2017): self-attention and a feed-forward layer,
    each residual and layer-normalized; padding masked."""

    def __init__(self, dim, heads, **kwargs):
        super().__init__(**kwargs)
        self.attention = keras.layers.MultiHeadAttention(heads, dim // heads)
        self.feed = keras.Sequential([keras.layers.Dense(2 * dim, activation="relu"), keras.layers.Dense(dim)])
        self.norm1, self.norm2 = keras.layers.LayerNormalization(), keras.layers.LayerNormalization()
        self.supports_masking = True

    def call(self, x, mask=None):
        padding = None if mask is None else mask[:, None, :]
        x = self.norm1(x + self.attention(x, x, attention_mask=padding))
        return self.norm2(x + self.feed(x))


def classifier(vocabulary: int, dim: int = 32) -> keras.Model:
    """Token ids ``(batch, length)`` int32, 0 for padding -> logits ``(batch, 2)``."""
    ids = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(vocabulary, dim, mask_zero=True)(ids)
    x = Encoder(dim, heads=2)(x)
    return keras.Model(ids, keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(x)))


hvdtrain.init_distributed()  # first: each rank pins its own GPU before TensorFlow starts
keras.utils.set_random_seed(0)  # the same run every time (rank 0's initial weights are broadcast)
texts, labels = reviews(a.train, 0)
test_texts, test_labels = reviews(a.test, 1)
if a.strings:  # the model takes strings: TextVectorization adapts to the training set (alike on every rank)
    vectorize = keras.layers.TextVectorization(max_tokens=64, standardize="lower", split="whitespace")
    vectorize.adapt(texts)
    inner = classifier(vectorize.vocabulary_size())
    strings = keras.Input((), dtype="string")
    model = keras.Model(strings, inner(vectorize(strings)))
    x, test_x = texts, test_texts
else:  # token ids, one ragged row per review: hvdtrain pads each batch to its longest
    vocabulary = {word: i + 1 for i, word in enumerate(sorted(set(GARMENTS + GOOD + BAD + FILLER)))}

    def ids(batch):
        return tf.ragged.constant([[vocabulary[w] for w in t.split()] for t in batch], dtype=tf.int32)

    model = classifier(len(vocabulary) + 1)
    x, test_x = ids(texts), ids(test_texts)
model.compile(keras.optimizers.Adam(2e-3), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
result = hvdtrain.fit(model, x=x, y=labels, validation_data=(test_x, test_labels), epochs=a.epochs, batch_size=32,
                      log={"dir": a.log_dir, "progress": False})
if result.is_chief:
    print(f"test accuracy {result.history[-1]['test_accuracy']:.4f}")
