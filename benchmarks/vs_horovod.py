"""hvdtrain's training step against a plain Horovod + Keras loop, same model, data, batch and ranks.

    .venv/bin/horovodrun -np 2 --gloo .venv/bin/python benchmarks/vs_horovod.py
    .venv/bin/python benchmarks/vs_horovod.py --launch 2        # the same, launched for you
    .venv/bin/python benchmarks/vs_horovod.py --launch 2 --transport mpi

The plain loop is written as Horovod's ``horovod/examples/tensorflow2/tensorflow2_mnist.py`` writes it: a
``tf.data`` pipeline (``from_tensor_slices`` -> ``repeat`` -> ``shuffle(10000)`` ->
``batch``), a ``tf.function`` step with ``hvd.DistributedGradientTape``, and variables broadcast
after the first step. Both loops live in the same processes (so they get the same cores and
threads), train the same seed CNN on Fashion-MNIST with the same SGD, and are timed in alternating
rounds, so machine noise hits both alike. Three pairs: the same layers in both (Keras'
``BatchNormalization``, per rank: the loops alone), per-rank BatchNorm as each one's user gets it
(hvdtrain's ``--no-sync-bn`` layer against Keras'), and synchronized BatchNorm (hvdtrain's layer
against Horovod's ``hvd.SyncBatchNormalization``).
Prints median step times, the ratio hvdtrain / plain (the median of the rounds' own ratios), and
each rank's peak memory. The ranks run with Horovod's default ``HOROVOD_DISABLE_GROUP_FUSION=0``
(hvdtrain's ``1`` would leave the plain loop's tensors unfused), so hvdtrain's step here runs with it
too; what hvdtrain's own setting costs its training is ``deterministic.py``'s "fused by timing".
"""
import argparse
import sys

import common


def plain_horovod_loop(ctx, model, x, y, batch_size: int, lr: float):
    """Horovod's TF2 example loop; returns ``run(n)``: n steps, waiting for the last."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices((tf.cast(x / 255.0, tf.float32), tf.cast(y, tf.int64)))
    # As in Horovod's example: no shard; each worker shuffles the whole training set.
    dataset = dataset.repeat().shuffle(10000).batch(batch_size)
    loss = tf.losses.SparseCategoricalCrossentropy(from_logits=True)
    # Horovod: scale the learning rate by the number of workers.
    opt = tf.optimizers.SGD(lr * hvd.size(), momentum=0.9)

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            loss_value = loss(labels, logits)
        # Horovod: add Horovod Distributed GradientTape.
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss_value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        # Horovod: broadcast initial variable states from rank 0 to all other processes, after
        # the first step so that the optimizer's slots exist.
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables(), root_rank=0)
        return loss_value

    batches = iter(dataset)
    state = {"first": True}

    def run(n: int) -> None:
        loss_value = None
        for _ in range(n):
            images, labels = next(batches)
            loss_value = training_step(images, labels, state["first"])
            state["first"] = False
        loss_value.numpy()

    return run


def worker(a) -> None:
    from hvdtrain.runtime.dist import init_distributed

    common.horovods_own_fusion()  # the plain loop fused as Horovod's users get it
    ctx = init_distributed(threads=a.threads)
    import tensorflow as tf
    from hvdtrain.model.zoo import norm_factory

    dataset = common.bench_dataset("cnn", a.batch_size, ctx.size)
    pairs = {"same layers (Keras BN)": (common.keras_batch_norm, common.keras_batch_norm),
             "per-rank BN": (norm_factory(False), common.keras_batch_norm),
             "synchronized BN": (norm_factory(True), common.horovod_sync_bn)}
    rows = []
    for pair, (ours_norm, plain_norm) in pairs.items():
        tf.keras.utils.set_random_seed(0)
        ours = common.build_bench_model("cnn", dataset, norm=ours_norm)
        _, run_ours = common.hvdtrain_stepper(ctx, ours, dataset, a.batch_size)
        tf.keras.utils.set_random_seed(0)
        plain = common.build_bench_model("cnn", dataset, norm=plain_norm)
        run_plain = plain_horovod_loop(ctx, plain, dataset.x_train, dataset.y_train, a.batch_size, lr=0.05)
        times = common.alternating_step_times(ctx, {"hvdtrain": run_ours, "plain": run_plain}, a.warmup,
                                              a.rounds, a.steps)
        rows.append([pair, times.median("hvdtrain") * 1e3, times.median("plain") * 1e3,
                     times.ratio("hvdtrain", "plain")])
    rss = common.gather_rss(ctx)
    if ctx.is_chief:
        common.print_table(
            ["model", "hvdtrain ms/step", "plain Horovod ms/step", "hvdtrain / plain"], rows,
            title=f"seed CNN, Fashion-MNIST, np={ctx.size}, local batch {a.batch_size}, {ctx.intra_op_threads} "
                  f"thread(s) per rank; {a.rounds} alternating rounds of {a.steps} steps: median step times, "
                  f"and the median of the rounds' ratios")
        print("peak RSS per rank (MiB, both loops in one process): " + ", ".join(f"{r:.0f}" for r in rss))
        common.grouped_bars(a.plot, [row[0] for row in rows],
                            {"hvdtrain": [row[1] for row in rows], "plain Horovod + Keras": [row[2] for row in rows]},
                            ylabel="ms per step (median)",
                            title=f"seed CNN, np={ctx.size}, local batch {a.batch_size}")
        common.write_result(a.result, {"rows": rows, "rss_mib": rss})
    ctx.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launch", type=common.positive_int, default=None, metavar="NP",
                   help="start NP ranks with horovodrun (see --transport)")
    p.add_argument("--transport", default="gloo", choices=["gloo", "mpi"], help="with --launch: Gloo or MPI")
    p.add_argument("--batch-size", type=common.positive_int, default=128, help="local batch per rank")
    p.add_argument("--rounds", type=common.positive_int, default=9)
    p.add_argument("--steps", type=common.positive_int, default=20, help="steps per loop per round")
    # At least 2: the plain loop's step is traced twice, for first_batch True and then False.
    p.add_argument("--warmup", type=common.at_least(2), default=10, help="untimed steps per loop first (tracing)")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads per rank (0: one per core of its share)")
    p.add_argument("--plot", default=str(common.REPO / "benchmarks" / "figures" / "vs_horovod.png"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.launch:
        args = [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
                if k in ("batch_size", "rounds", "steps", "warmup", "threads", "plot")]
        common.run_job(a.launch, __file__, args, a.transport, stream=True)
    else:
        worker(a)


if __name__ == "__main__":
    sys.exit(main())
