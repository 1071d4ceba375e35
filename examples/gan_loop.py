"""A GAN in your own GradientTape loop on N ranks: Horovod's TF2 API on Keras 3 objects, and
hvdtrain's pieces for what a loop must get exactly right (hvdtrain.loop).

    horovodrun -np 2 python examples/gan_loop.py [--train 20000] [--epochs 2] [--ckpt-dir runs/gan_loop]

Two dense networks on Fashion-MNIST (Debian's copy), each with its own Adam, each step
``hvd.DistributedGradientTape``'s. N ranks at local batch B train what one process trains at
batch N·B, to rounding: each rank takes its exact shard of each global batch, the per-example noise
is sharded with the images, each rank's mean loss is weighted by ``batch.loss_weight`` (so Horovod's
average of the ranks' means is the global batch's mean, also on the short last step), and the
epoch's losses are global sums, not a mean of the ranks' means. Run it again with more
``--epochs`` and it resumes from rank 0's newest checkpoint.

Goodfellow et al. 2014, "Generative Adversarial Networks".
"""
import argparse
import json

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

import hvdtrain
from hvdtrain.data.in_memory import load_idx_dir
from hvdtrain.loop import Checkpoints, global_results, rank_batches

p = argparse.ArgumentParser()
p.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
p.add_argument("--train", type=int, default=20000, help="first N training images")
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--batch-size", type=int, default=32, help="local batch: examples per rank per step")
p.add_argument("--lr", type=float, default=3e-4)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--ckpt-dir", default="runs/gan_loop/checkpoints")
p.add_argument("--out", help="rank 0 writes the weights (OUT.npz) and each epoch's global losses (OUT.json)")
a = p.parse_args()
LATENT = 32

# 1-2. hvd.init, and this rank's own GPU (or CPU cores): before the first op starts TensorFlow's runtime.
ctx = hvdtrain.init_distributed()
try:
    keras.utils.set_random_seed(a.seed)  # any weights will do: rank 0's are broadcast below
    discriminator = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(), keras.layers.Dense(128),
                                      keras.layers.LeakyReLU(0.2), keras.layers.Dense(1)])
    generator = keras.Sequential([keras.Input((LATENT,)), keras.layers.Dense(128), keras.layers.LeakyReLU(0.2),
                                  keras.layers.Dense(784, activation="sigmoid"), keras.layers.Reshape((28, 28, 1))])
    # 4. No learning-rate scaling: these are one process's rates at the global batch, which N ranks
    # at local batch B reproduce (Horovod's examples scale by N to keep a one-process batch B's rate).
    d_optimizer, g_optimizer = keras.optimizers.Adam(a.lr), keras.optimizers.Adam(a.lr)
    d_optimizer.build(discriminator.trainable_variables)  # slots exist before the broadcast and checkpoints
    g_optimizer.build(generator.trainable_variables)

    # 6. Every rank starts from rank 0's state: its newest checkpoint, or its initial weights.
    checkpoints = Checkpoints(ctx, a.ckpt_dir, discriminator=discriminator, generator=generator,
                              d_optimizer=d_optimizer, g_optimizer=g_optimizer)
    first_epoch = checkpoints.restore()

    # 3. This rank's shard of each global batch (hvdtrain.ShardPlan): every image once per epoch, equal steps.
    images = load_idx_dir(a.data_dir).x_train[:a.train]
    plan = hvdtrain.ShardPlan(len(images), a.batch_size, ctx.size, ctx.rank, seed=a.seed)
    if ctx.is_chief:
        print(f"world size {ctx.size} x local batch {plan.local_batch} = global batch {plan.global_batch}; "
              f"{plan.num_examples} images, {plan.steps_per_epoch} steps per epoch; from epoch {first_epoch + 1}")

    loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)  # the mean over this rank's batch
    d_loss_metric, g_loss_metric = keras.metrics.Mean(name="d_loss"), keras.metrics.Mean(name="g_loss")

    @tf.function(reduce_retracing=True)
    def train_step(real, noise, loss_weight):
        real = tf.cast(real, "float32") / 255.0
        n = tf.shape(real)[0]
        with tf.GradientTape() as tape:
            logits = discriminator(tf.concat([generator(noise[:, 0]), real], 0))
            d_loss = loss_fn(tf.concat([tf.ones((n, 1)), tf.zeros((n, 1))], 0), logits)
            weighted = d_loss * loss_weight  # on the tape: the average of these over ranks is the global mean
        # 5. Horovod averages each network's gradients over ranks before its optimizer applies them.
        grads = hvd.DistributedGradientTape(tape).gradient(weighted, discriminator.trainable_variables)
        d_optimizer.apply_gradients(zip(grads, discriminator.trainable_variables))
        with tf.GradientTape() as tape:
            g_loss = loss_fn(tf.zeros((n, 1)), discriminator(generator(noise[:, 1])))
            weighted = g_loss * loss_weight
        grads = hvd.DistributedGradientTape(tape).gradient(weighted, generator.trainable_variables)
        g_optimizer.apply_gradients(zip(grads, generator.trainable_variables))
        d_loss_metric.update_state(d_loss, sample_weight=n)  # sums of loss x examples: global_results adds them
        g_loss_metric.update_state(g_loss, sample_weight=n)

    history = []
    for epoch in range(first_epoch, a.epochs):
        # Each image's noise is the epoch's, drawn alike on every rank and sharded with it.
        noise = np.random.default_rng([a.seed, epoch]).normal(size=(len(images), 2, LATENT)).astype("float32")
        for batch in rank_batches((images, noise), plan, epoch):  # 7. the same steps on every rank
            train_step(*batch.examples, tf.constant(batch.loss_weight, tf.float32))
        losses = global_results(ctx, [d_loss_metric, g_loss_metric])  # over every image of the epoch
        for metric in (d_loss_metric, g_loss_metric):
            metric.reset_state()
        checkpoints.save(epoch + 1)  # 8. rank 0 writes; every rank calls it
        history.append(losses)
        if ctx.is_chief:
            print(f"epoch {epoch + 1}/{a.epochs}: discriminator loss {losses['d_loss']:.4f}, "
                  f"generator loss {losses['g_loss']:.4f}")
    if ctx.is_chief and a.out:
        weights = {v.path: v.numpy() for net in (discriminator, generator) for v in net.weights}
        np.savez(a.out + ".npz", **weights)
        with open(a.out + ".json", "w") as f:
            json.dump({"world_size": ctx.size, "first_epoch": first_epoch, "history": history}, f)
finally:
    ctx.close()
