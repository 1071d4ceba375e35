"""Rank worker: train each loss/metrics case for a few steps at chosen local batches; save the
weights and the global metric sums.

Usage: python -m tests.workers.objectives OUT.npz SIZES STEPS CASE[,CASE...]
SIZES is a comma-separated local batch size per rank; step s trains on the s-th block of
sum(SIZES) training examples, rank r on its SIZES[r] consecutive examples of it, so every world
size sees the same global batches. Per case, ``<case>/initial_eval``: the global evaluation sums of
the broadcast initial model (the same weights at every world size, so the same predictions: the
sums must be equal exactly), ``<case>/final/<i>``: the variables after training.
"""
import sys

import numpy as np

from hvdtrain.data.in_memory import make_synthetic, validate
from hvdtrain.data.sharding import ShardPlan
from hvdtrain.runtime.dist import init_distributed

# case -> (loss, label smoothing, metrics, labels, model, learning rate). The U-Net's rate is
# lower: at 0.05 its loss jumps, and such steps amplify float32 rounding past 1e-5 within 10 steps.
CASES = {
    "smoothing": ("sparse_categorical_crossentropy", 0.2, ("accuracy", "top5"), "classes", "tests.helpers.models:cnn_sync_bn",
                  0.05),
    "multilabel": ("binary_crossentropy", 0.0, ("accuracy",), "multilabel", "tests.helpers.models:cnn_sync_bn", 0.05),
    "regression": ("mse", 0.0, (), "regression", "tests.helpers.models:cnn_sync_bn", 0.05),
    "segmentation": ("sparse_categorical_crossentropy", 0.0, ("accuracy", "mean_iou"), "dense", "unet", 0.01),
    # A user's own optimizer on a Keras schedule object, used as it is (horovod#1573).
    "users_optimizer": ("sparse_categorical_crossentropy", 0.0, ("accuracy",), "classes", "tests.helpers.models:cnn_sync_bn",
                        "adam on CosineDecay(0.01, 10)"),
}


def task_data(kind: str, num_train: int, seed: int = 3):
    """8x8 synthetic images with labels of ``kind``: ``classes`` (10), ``dense`` (per pixel: the
    image's class + 1 where the pixel is bright, else 0), ``multilabel`` (4 bits of the class) or
    ``regression`` (3 pixel values in [0, 1])."""
    data = make_synthetic(num_train=num_train, num_test=37, image_shape=(8, 8, 1), seed=seed)
    if kind == "classes":
        return data

    def labels(x, y):
        if kind == "dense":
            return np.where(x[..., 0] > 127, y[:, None, None] + 1, 0).astype(np.int32)
        if kind == "multilabel":
            return ((y[:, None] >> np.arange(4)) & 1).astype(np.float32)
        return x.reshape(len(x), -1)[:, :3].astype(np.float32) / 255.0

    return validate(data.x_train, labels(data.x_train, data.y_train), data.x_test, labels(data.x_test, data.y_test),
                    name=kind, labels="classes" if kind == "dense" else "targets")


def main():
    out, sizes, steps, cases = sys.argv[1], [int(s) for s in sys.argv[2].split(",")], int(sys.argv[3]), sys.argv[4]
    ctx = init_distributed(threads=1)
    import tensorflow as tf
    from hvdtrain.config import OptimConfig
    from hvdtrain.losses import get_loss
    from hvdtrain.model.zoo import build_model
    from hvdtrain.optim import build_optimizer, users_optimizer
    from hvdtrain.task import build_objective, expected_outputs
    from hvdtrain.recipe_steps import broadcast_state
    from hvdtrain.trainer import Trainer

    assert len(sizes) == ctx.size, f"{len(sizes)} sizes for world size {ctx.size}"
    global_batch, arrays = sum(sizes), {}
    for case in cases.split(","):
        loss_name, smoothing, metric_names, kind, model_name, lr = CASES[case]
        dataset = task_data(kind, global_batch * steps)
        loss = get_loss(loss_name, smoothing)
        objective = build_objective(loss, metric_names, dataset)
        tf.keras.utils.set_random_seed(3 + ctx.rank)  # different per rank: the broadcast must fix it
        model = build_model(model_name, dataset.input_shape, dataset.num_classes, **expected_outputs(loss, dataset))
        if isinstance(lr, str):
            schedule = tf.keras.optimizers.schedules.CosineDecay(0.01, decay_steps=steps)
            optimizer = users_optimizer(tf.keras.optimizers.Adam(schedule), OptimConfig())
            optimizer.build(model.trainable_variables)
        else:
            config = OptimConfig(base_lr=lr / ctx.size, warmup_epochs=0, lr_schedule="constant")
            optimizer, _ = build_optimizer(config, ctx.size, steps_per_epoch=steps, epochs=1,
                                           variables=model.trainable_variables)
        broadcast_state(ctx, model, optimizer)
        arrays.update({f"{case}/initial/{i}": v.numpy() for i, v in enumerate(model.variables)})
        plan = ShardPlan(dataset.num_train, sizes[ctx.rank], ctx.size, ctx.rank)
        trainer = Trainer(ctx, model, optimizer, dataset, plan, eval_batch_size=7, objective=objective)
        arrays[f"{case}/initial_eval"] = ctx.allreduce_sum(_eval_sums(trainer), name=f"{case}.eval")
        offset = sum(sizes[:ctx.rank])
        for step in range(steps):
            block = np.arange(step * global_batch, (step + 1) * global_batch, dtype=np.int32)
            trainer.train_step(block[offset:offset + sizes[ctx.rank]], np.float32(global_batch))
        arrays[f"{case}/train_sums"] = ctx.allreduce_sum(trainer._sums.numpy(), name=f"{case}.train")
        arrays.update({f"{case}/final/{i}": v.numpy() for i, v in enumerate(model.variables)})
    np.savez(out.replace(".npz", f".rank{ctx.rank}.npz"), **arrays)
    ctx.close()


def _eval_sums(trainer) -> np.ndarray:
    """This rank's evaluation sums over its shard of the test set (uneven: 37 examples)."""
    n, sums = int(trainer.y_test.shape[0]), np.zeros(trainer.objective.size)
    for start in range(0, n, trainer.eval_batch_size):
        sums += trainer.eval_step(start, min(start + trainer.eval_batch_size, n)).numpy()
    return sums


if __name__ == "__main__":
    main()
