"""A GAN through hvdtrain.fit, on Fashion-MNIST: the model's own train_step with two optimizers.

    horovodrun -np 2 python examples/gan.py

keras.io's GAN pattern ("DCGAN: overriding train_step"), with dense networks to
stay small: train_step steps the discriminator's optimizer, then the generator's. hvdtrain wraps
both, so each update's gradients are summed over ranks, count-weighted, before it is applied; the
data are images alone (no labels), and there is no test set.

Goodfellow et al. 2014, "Generative Adversarial Networks".
"""
import argparse

import keras
import tensorflow as tf

import hvdtrain
from hvdtrain.data.in_memory import load_idx_dir

p = argparse.ArgumentParser()
p.add_argument("--train", type=int, default=20000)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--log-dir", default="runs/gan")
a = p.parse_args()
LATENT = 32


class GAN(keras.Model):
    def __init__(self, discriminator, generator):
        super().__init__()
        self.discriminator, self.generator = discriminator, generator
        self.seed_generator = keras.random.SeedGenerator(1337)
        self.d_loss_metric, self.g_loss_metric = keras.metrics.Mean(name="d_loss"), keras.metrics.Mean(name="g_loss")

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn

    @property
    def metrics(self):
        return [self.d_loss_metric, self.g_loss_metric]

    def train_step(self, data):
        real = tf.cast(data[0] if isinstance(data, tuple) else data, "float32") / 255.0
        batch = tf.shape(real)[0]
        noise = keras.random.normal((batch, LATENT), seed=self.seed_generator)
        images = tf.concat([self.generator(noise), real], 0)
        labels = tf.concat([tf.ones((batch, 1)), tf.zeros((batch, 1))], 0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(images))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        noise = keras.random.normal((batch, LATENT), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(tf.zeros((batch, 1)), self.discriminator(self.generator(noise)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_metric.update_state(d_loss, sample_weight=batch)
        self.g_loss_metric.update_state(g_loss, sample_weight=batch)
        return {"d_loss": self.d_loss_metric.result(), "g_loss": self.g_loss_metric.result()}


hvdtrain.init_distributed()  # first: each rank pins its own GPU before TensorFlow starts (the models below start it)
keras.utils.set_random_seed(0)  # the same run every time (rank 0's initial weights are broadcast)
discriminator = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(),
                                  keras.layers.Dense(128), keras.layers.LeakyReLU(0.2), keras.layers.Dense(1)])
generator = keras.Sequential([keras.Input((LATENT,)), keras.layers.Dense(128), keras.layers.LeakyReLU(0.2),
                              keras.layers.Dense(784, activation="sigmoid"), keras.layers.Reshape((28, 28, 1))])

fashion = load_idx_dir("/usr/share/datasets/fashion-mnist")
gan = GAN(discriminator, generator)
gan.compile(keras.optimizers.Adam(3e-4), keras.optimizers.Adam(3e-4), keras.losses.BinaryCrossentropy(from_logits=True))
result = hvdtrain.fit(gan, x=fashion.x_train[:a.train], epochs=a.epochs, batch_size=64,
                      log={"dir": a.log_dir, "progress": False})
if result.is_chief:
    last = result.history[-1]
    print(f"discriminator loss {last['train_d_loss']:.4f}, generator loss {last['train_g_loss']:.4f}")
