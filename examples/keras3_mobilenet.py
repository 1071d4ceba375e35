"""A Keras 3 model through hvdtrain.fit: Keras 3's MobileNetV2 on Fashion-MNIST, as 32x32 RGB.

    horovodrun -np 2 python examples/keras3_mobilenet.py

Your Keras 3 code as you write it (`import keras`, TensorFlow backend): a keras.applications model
whose 52 BatchNormalization layers hvdtrain converts to synchronized ones, your own AdamW, and
Keras 3 callbacks; Horovod averages the gradients across the ranks.
"""
import argparse

import keras
import numpy as np

import hvdtrain
from hvdtrain.data.in_memory import load_idx_dir

p = argparse.ArgumentParser()
p.add_argument("--train", type=int, default=20000, help="training images (of 60,000)")
p.add_argument("--test", type=int, default=10000, help="test images (of 10,000)")
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--log-dir", default=None)
a = p.parse_args()


def build(input_shape, num_classes):
    """Called by hvdtrain with the data's image shape and class count: Keras 3's own MobileNetV2."""
    model = keras.applications.MobileNetV2(input_shape=input_shape, alpha=0.35, weights=None, classes=num_classes,
                                           classifier_activation=None)
    for layer in model.layers:  # moving statistics that settle in ~50 steps (0.99: ~500), so the first
        if isinstance(layer, keras.layers.BatchNormalization):  # epoch's evaluation is already sound
            layer.momentum = 0.9
    return model


def rgb32(images):
    """(n, 28, 28, 1) grey -> (n, 32, 32, 3): padded to MobileNetV2's smallest input, grey in 3 channels."""
    return np.repeat(np.pad(images, ((0, 0), (2, 2), (2, 2), (0, 0))), 3, -1)


hvdtrain.init_distributed()  # first: each rank pins its own GPU before TensorFlow starts (AdamW below starts it)
fashion = load_idx_dir("/usr/share/datasets/fashion-mnist")
data = (rgb32(fashion.x_train[:a.train]), fashion.y_train[:a.train], rgb32(fashion.x_test[:a.test]),
        fashion.y_test[:a.test])
result = hvdtrain.fit(build, data, loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                      optimizer=keras.optimizers.AdamW(2e-3, weight_decay=1e-4),
                      callbacks=[keras.callbacks.EarlyStopping(monitor="val_accuracy", patience=2,
                                                               restore_best_weights=True)],
                      convert_sync_bn=True, epochs=a.epochs, batch_size=64,
                      log={"dir": a.log_dir, "progress": False})
if result.is_chief:
    for epoch, metrics in enumerate(result.history, 1):
        print(f"epoch {epoch}: test accuracy {metrics['test_accuracy']:.4f}")
