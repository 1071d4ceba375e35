"""Rank worker: run hvdtrain's compiled training step with chosen local batches; save the weights.

Usage: python -m tests.workers.train_steps OUT.npz MODEL SIZES STEPS [--lr LR] [--fp16-allreduce]
           [--backward-passes-per-step K] [--optimizer NAME] [--nesterov] [--weight-decay WD] [--clip-norm C]
           [--precision fp32|bf16|fp16|fp64] [--xla] [--overflow RANK:STEP] [--reverse] [--convert-sync-bn]
           [--users-optimizer]
SIZES is a comma-separated local batch size per rank (e.g. "16,16", "3,13", or "32" for one
process). Step s uses the s-th block of sum(SIZES) examples of a fixed permutation; rank r takes
its SIZES[r] consecutive examples of that block -- so every world size sees the same global batches.
The effective learning rate is LR whatever the world size (the base rate is LR / world size).
--reverse feeds each global batch's examples in reverse order (the same batch, summed in another order).
--overflow RANK:STEP scales that rank's images at that step (0-based) by 1e6: float16 activations
overflow there, on that rank only. Weights are also saved before that step ("before_overflow/").
--convert-sync-bn converts the model's Keras BatchNormalization layers; --users-optimizer trains with
an optimizer built here of the model's Keras (Keras' Adam on LR), as a user's own, not hvdtrain's.
"""
import argparse

import numpy as np

from hvdtrain.config import OptimConfig
from hvdtrain.data.in_memory import make_synthetic
from hvdtrain.runtime.dist import init_distributed
from hvdtrain.data.sharding import ShardPlan


def order_of(seed, n):
    """The fixed permutation whose consecutive blocks are the global batches."""
    return np.random.default_rng(seed).permutation(n).astype(np.int32)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("model")
    p.add_argument("sizes")
    p.add_argument("steps", type=int)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--fp16-allreduce", action="store_true")
    p.add_argument("--backward-passes-per-step", type=int, default=1)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--nesterov", action="store_true")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip-norm", type=float, default=0.0)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--xla", action="store_true")
    p.add_argument("--overflow", default="-1:-1")
    p.add_argument("--reverse", action="store_true")
    p.add_argument("--convert-sync-bn", action="store_true")
    p.add_argument("--users-optimizer", action="store_true")
    a = p.parse_args()

    ctx = init_distributed(threads=1)
    import tensorflow as tf
    from hvdtrain import kerases
    from hvdtrain.model.zoo import build_model
    from hvdtrain.optim import build_optimizer, users_optimizer
    from hvdtrain.precision import DynamicLossScale, set_precision
    from hvdtrain.step import gathered, make_train_step
    from hvdtrain.recipe_steps import broadcast_state
    from hvdtrain.trainer import Trainer

    sizes = [int(s) for s in a.sizes.split(",")]
    assert len(sizes) == ctx.size, f"{len(sizes)} sizes for world size {ctx.size}"
    global_batch = sum(sizes)
    dataset = make_synthetic(num_train=global_batch * a.steps, num_test=10, image_shape=(8, 8, 1), seed=a.seed)
    kerases.set_random_seed(a.seed + ctx.rank)  # different per rank: the broadcast must fix it
    set_precision(a.precision)
    model = build_model(a.model, dataset.input_shape, dataset.num_classes, seed=a.seed, rank=ctx.rank,
                        convert_sync_bn=a.convert_sync_bn, world_size=ctx.size)
    keras = kerases.module(kerases.version_of(model))
    config = OptimConfig(name=a.optimizer, base_lr=a.lr / ctx.size, momentum=0.9, nesterov=a.nesterov,
                         weight_decay=a.weight_decay, clip_norm=a.clip_norm, warmup_epochs=0, lr_schedule="constant",
                         fp16_allreduce=a.fp16_allreduce, backward_passes_per_step=a.backward_passes_per_step)
    if a.users_optimizer:
        optimizer = users_optimizer(keras.optimizers.Adam(a.lr, global_clipnorm=a.clip_norm or None), config)
        optimizer.build(model.trainable_variables)
    else:
        optimizer, _ = build_optimizer(config, ctx.size, steps_per_epoch=a.steps, epochs=1,
                                       variables=model.trainable_variables, keras=keras)
    loss_scale = DynamicLossScale(optimizer) if a.precision == "fp16" else None
    before = [v.numpy() for v in model.variables]
    broadcast_state(ctx, model, optimizer)
    initial = [v.numpy() for v in model.variables]

    trainer = Trainer(ctx, model, optimizer, dataset, ShardPlan(len(dataset.y_train), sizes[ctx.rank], ctx.size, ctx.rank),
                      loss_scale=loss_scale, xla=a.xla)
    overflow_rank, overflow_step = map(int, a.overflow.split(":"))
    if overflow_rank == ctx.rank:
        x = dataset.x_train.astype(np.float32) * np.float32(1.0 / 255.0)  # as to_model_input scales
        block = order_of(a.seed, len(x))[overflow_step * global_batch:(overflow_step + 1) * global_batch]
        x[block[sum(sizes[:ctx.rank]):sum(sizes[:ctx.rank + 1])]] *= 1e6
        trainer.x_train = tf.constant(x)
        trainer.train_step, _ = make_train_step(model, optimizer, ctx.size, gathered(trainer.x_train, trainer.y_train),
                                                trainer.objective, trainer._sums, loss_scale)
    order = order_of(a.seed, len(dataset.y_train))
    offset = sum(sizes[:ctx.rank])
    after_first, before_overflow, after_overflow = [], [], []
    for step in range(a.steps):
        if step == overflow_step:
            before_overflow = [v.numpy() for v in model.variables]
        block = order[step * global_batch:(step + 1) * global_batch]
        if a.reverse:
            block = block[::-1]
        trainer.train_step(block[offset:offset + sizes[ctx.rank]], np.float32(global_batch))
        if step == 0:
            after_first = [v.numpy() for v in model.variables]
        if step == overflow_step:
            after_overflow = [v.numpy() for v in model.variables]

    arrays = {f"before_broadcast/{i}": w for i, w in enumerate(before)}
    arrays.update({f"initial/{i}": w for i, w in enumerate(initial)})
    arrays.update({f"step1/{i}": w for i, w in enumerate(after_first)})
    arrays.update({f"final/{i}": v.numpy() for i, v in enumerate(model.variables)})
    arrays.update({f"before_overflow/{i}": w for i, w in enumerate(before_overflow)})
    arrays.update({f"after_overflow/{i}": w for i, w in enumerate(after_overflow)})
    if a.xla:  # XLA's HLO exists only for a function it compiled
        images, labels = tf.cast(trainer.x_train[:2], tf.float32), trainer.y_train[:2]
        hlo = trainer.local_gradients.experimental_get_compiler_ir(images, labels, tf.constant(2.0))(stage="hlo")
        arrays["compiled_by_xla"] = np.array("HloModule" in hlo)
    arrays["iterations"] = np.array(int(optimizer.iterations.numpy()))
    if loss_scale is not None:
        arrays["loss_scale"] = loss_scale.scale.numpy()
        arrays["skipped_steps"] = loss_scale.skipped_steps.numpy()
    np.savez(a.out.replace(".npz", f".rank{ctx.rank}.npz"), **arrays)
    ctx.close()


if __name__ == "__main__":
    main()
