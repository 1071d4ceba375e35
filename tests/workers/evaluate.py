"""Rank worker: evaluate a fixed model over a test set split across ranks; save the global metrics.

Usage: python -m tests.workers.evaluate OUT_DIR NUM_TEST
Rank 0 also saves the model weights so the test can recompute the metrics in one process.
"""
import sys

import numpy as np

from hvdtrain.runtime.dist import init_distributed


def main(out_dir: str, num_test: int) -> None:
    ctx = init_distributed(threads=1)
    import tensorflow as tf
    from hvdtrain.data.in_memory import make_synthetic
    from hvdtrain.model.zoo import build_model
    from hvdtrain.data.sharding import ShardPlan
    from hvdtrain.trainer import Trainer

    dataset = make_synthetic(num_train=64, num_test=num_test, image_shape=(8, 8, 1), seed=5)
    tf.keras.utils.set_random_seed(11)  # same weights on every rank: no broadcast needed here
    model = build_model("tests.helpers.models:mlp", dataset.input_shape, dataset.num_classes)
    trainer = Trainer(ctx, model, optimizer=None, dataset=dataset,
                      plan=ShardPlan(64, 8, ctx.size, ctx.rank), eval_batch_size=7)
    metrics = trainer.evaluate()
    np.savez(f"{out_dir}/rank{ctx.rank}.npz", loss=metrics["loss"], accuracy=metrics["accuracy"],
             count=metrics["count"], **{f"w{i}": w for i, w in enumerate(model.get_weights())})
    ctx.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
