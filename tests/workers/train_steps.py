"""Rank worker: run hvdtrain's compiled training step with chosen local batches; save the weights.

Usage: python -m tests.workers.train_steps OUT.npz MODEL SIZES STEPS [--lr LR] [--fp16-allreduce]
           [--backward-passes-per-step K] [--optimizer NAME] [--nesterov] [--weight-decay WD] [--clip-norm C]
SIZES is a comma-separated local batch size per rank (e.g. "16,16", "3,13", or "32" for one
process). Step s uses the s-th block of sum(SIZES) examples of a fixed permutation; rank r takes
its SIZES[r] consecutive examples of that block -- so every world size sees the same global batches.
The effective learning rate is LR whatever the world size (the base rate is LR / world size).
"""
import argparse

import numpy as np

from hvdtrain.config import OptimConfig
from hvdtrain.data.datasets import make_synthetic
from hvdtrain.runtime.dist import init_distributed
from hvdtrain.data.sharding import ShardPlan


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
    a = p.parse_args()

    ctx = init_distributed(threads=1)
    import tensorflow as tf
    from hvdtrain.model.zoo import build_model
    from hvdtrain.optim import build_optimizer
    from hvdtrain.trainer import Trainer, broadcast_state

    sizes = [int(s) for s in a.sizes.split(",")]
    assert len(sizes) == ctx.size, f"{len(sizes)} sizes for world size {ctx.size}"
    global_batch = sum(sizes)
    dataset = make_synthetic(num_train=global_batch * a.steps, num_test=10, image_shape=(8, 8, 1), seed=a.seed)
    tf.keras.utils.set_random_seed(a.seed + ctx.rank)  # different per rank: the broadcast must fix it
    model = build_model(a.model, dataset.input_shape, dataset.num_classes, seed=a.seed, rank=ctx.rank)
    config = OptimConfig(name=a.optimizer, base_lr=a.lr / ctx.size, momentum=0.9, nesterov=a.nesterov,
                         weight_decay=a.weight_decay, clip_norm=a.clip_norm, warmup_epochs=0, lr_schedule="constant",
                         fp16_allreduce=a.fp16_allreduce, backward_passes_per_step=a.backward_passes_per_step)
    optimizer, _ = build_optimizer(config, ctx.size, steps_per_epoch=a.steps, epochs=1,
                                   variables=model.trainable_variables)
    before = [v.numpy() for v in model.variables]
    broadcast_state(ctx, model, optimizer)
    initial = [v.numpy() for v in model.variables]

    trainer = Trainer(ctx, model, optimizer, dataset, ShardPlan(len(dataset.y_train), sizes[ctx.rank], ctx.size, ctx.rank))
    order = np.random.default_rng(a.seed).permutation(len(dataset.y_train)).astype(np.int32)
    offset = sum(sizes[:ctx.rank])
    after_first = []
    for step in range(a.steps):
        block = order[step * global_batch:(step + 1) * global_batch]
        trainer.train_step(block[offset:offset + sizes[ctx.rank]], np.float32(global_batch))
        if step == 0:
            after_first = [v.numpy() for v in model.variables]

    arrays = {f"before_broadcast/{i}": w for i, w in enumerate(before)}
    arrays.update({f"initial/{i}": w for i, w in enumerate(initial)})
    arrays.update({f"step1/{i}": w for i, w in enumerate(after_first)})
    arrays.update({f"final/{i}": v.numpy() for i, v in enumerate(model.variables)})
    arrays["iterations"] = np.array(int(optimizer.iterations.numpy()))
    np.savez(a.out.replace(".npz", f".rank{ctx.rank}.npz"), **arrays)
    ctx.close()


if __name__ == "__main__":
    main()
