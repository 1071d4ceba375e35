"""Where a training step at np ranks loses time against np=1: compute, synchronization, gradient bytes.

    .venv/bin/python benchmarks/step_breakdown.py                 # seed CNN, per-rank BN, MPI, np = 1 and 2
    .venv/bin/python benchmarks/step_breakdown.py --sync-bn       # with hvdtrain's SyncBatchNormalization

Every job times five variants of the same step in alternating rounds (hvdtrain's compiled step on
real Fashion-MNIST, local batch 128, one core per rank), so machine noise hits them alike:

* ``no collectives``: the plain optimizer; the ranks compute independently (synchronized BN
  layers, with ``--sync-bn``, still make their allreduces);
* ``barrier``: the same plus one payload-free allreduce per step after the backward pass: what
  waiting for the slower rank costs;
* ``hvdtrain``: ``hvd.DistributedOptimizer``, the gradients allreduced (the real step): Horovod
  negotiates each gradient as the backward pass produces it, and fuses what is ready together.
  Its optimizer is hvdtrain's own, with the cosine learning-rate schedule, where the other
  variants use a constant rate: "hvdtrain - barrier" also counts the schedule's few scalar ops;
* ``one group``: the same with Horovod's ``groups=1``: one grouped allreduce of every gradient,
  negotiated once, after the backward pass (what per-gradient negotiation costs);
* ``allreduce only``: the allreduce of a gradient-sized float32 tensor in a compiled function, no
  compute: the communication alone.

Jobs at np = 1 and 2 alternate ``--repeats`` times; each step time is the median over repeats of each
job's median step time, and each np=2 / np=1 ratio the median over repeats of the repeat's own
ratio. Prints a table of ms per step and the costs derived from it, and writes a PNG plot.
"""
import statistics
import sys

import numpy as np

import common


def worker(a) -> None:
    from hvdtrain.runtime.dist import init_distributed

    ctx = init_distributed(threads=1, use_gpu=False)
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from hvdtrain.model.zoo import norm_factory, seed_cnn

    dataset = common.bench_dataset("cnn", a.batch_size, ctx.size)

    class BarrierSGD(tf.keras.optimizers.SGD):
        """SGD that waits, after the backward pass, in one allreduce of a single zero."""

        def compute_gradients(self, loss, var_list, tape=None):
            grads = super().compute_gradients(loss, var_list, tape=tape)
            ready = tf.add_n([tf.reduce_sum(g) for g, _ in grads]) * 0.0  # after every gradient exists
            token = hvd.allreduce(ready[None], op=hvd.Sum, name="bench.barrier")
            with tf.control_dependencies([token]):
                return [(tf.identity(g), v) for g, v in grads]

    def training_steps(variant):
        tf.keras.utils.set_random_seed(0)
        model = seed_cnn(dataset.input_shape, dataset.num_classes, norm=norm_factory(a.sync_bn))
        optimizer = {"hvdtrain": lambda: None, "one group": common.one_group_sgd,
                     "barrier": lambda: BarrierSGD(0.05, momentum=0.9),
                     "no collectives": lambda: tf.keras.optimizers.SGD(0.05, momentum=0.9)}[variant]()
        trainer, run = common.hvdtrain_stepper(ctx, model, dataset, a.batch_size, optimizer)
        if variant == "one group":
            common.check_grouped(trainer)
        return run, sum(v.shape.num_elements() for v in model.trainable_variables)

    runs = {}
    for variant in ("no collectives", "barrier", "hvdtrain", "one group"):
        runs[variant], gradient_elements = training_steps(variant)
    gradients = tf.Variable(tf.ones([gradient_elements]))

    @tf.function
    def allreduce_only():
        gradients.assign(hvd.allreduce(gradients, op=hvd.Average, name="bench.gradients"))

    def run_allreduce(n):
        for _ in range(n):
            allreduce_only()
        gradients.numpy()

    runs["allreduce only"] = run_allreduce
    medians = common.alternating_step_times(ctx, runs, a.warmup, a.rounds, a.steps).medians()
    rss = common.gather_rss(ctx)
    if ctx.is_chief:
        common.write_result(a.result, {"np": ctx.size, "ms": {k: v * 1e3 for k, v in medians.items()},
                                       "gradient_mib": gradient_elements * 4 / 2**20, "rss_mib": rss})
    ctx.close()


def driver(a) -> None:
    jobs = common.step_variant_jobs(__file__, a, lambda r: ", ".join(f"{k} {v:.2f} ms" for k, v in r["ms"].items()))
    variants = list(jobs[1][0]["ms"])
    ms = {np_: {v: statistics.median(r["ms"][v] for r in runs) for v in variants} for np_, runs in jobs.items()}

    def paired(variant: str, np_: int, other: int) -> float:  # by repeat: jobs at np=1 and 2 alternate
        return common.median_ratio([r["ms"][variant] for r in jobs[np_]], [r["ms"][variant] for r in jobs[other]])

    mib = jobs[1][0]["gradient_mib"]
    common.print_table(["variant", "np=1 ms/step", "np=2 ms/step", "np=2 / np=1"],
                       [[v, f"{ms[1][v]:.2f}", f"{ms[2][v]:.2f}", f"{paired(v, 2, 1):.3f}"] for v in variants],
                       title=f"seed CNN, {'synchronized' if a.sync_bn else 'per-rank'} BN, local batch {a.batch_size}, "
                             f"{a.transport}, one core per rank; step times: median of {a.repeats} jobs per np; np=2 / np=1: "
                             f"median of the repeats' own ratios")
    two, one = ms[2], ms[1]
    common.print_table(["cost at np=2", "ms/step", "share of the np=2 step"], [
        ["compute slowdown (no collectives, np=2 - np=1)", f"{two['no collectives'] - one['no collectives']:.2f}",
         f"{(two['no collectives'] - one['no collectives']) / two['hvdtrain']:.1%}"],
        ["waiting for the slower rank (barrier - no collectives)", f"{two['barrier'] - two['no collectives']:.2f}",
         f"{(two['barrier'] - two['no collectives']) / two['hvdtrain']:.1%}"],
        [f"gradient allreduce in the step ({mib:.2f} MiB; hvdtrain - barrier)", f"{two['hvdtrain'] - two['barrier']:.2f}",
         f"{(two['hvdtrain'] - two['barrier']) / two['hvdtrain']:.1%}"],
        ["the same allreduce alone", f"{two['allreduce only']:.2f}", f"{two['allreduce only'] / two['hvdtrain']:.1%}"],
        ["scaling efficiency (np=1 / np=2 step time)", f"{paired('hvdtrain', 1, 2):.3f}", ""],
    ])
    common.print_job_rss(jobs)
    plt = common.matplotlib_pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    x = np.arange(len(variants))
    for i, np_ in enumerate(ms):
        ax.bar(x + (i - 0.5) * 0.4, [ms[np_][v] for v in variants], 0.4, label=f"np={np_}")
    ax.set(xticks=x, xticklabels=variants, ylabel="ms per step (median)",
           title=f"seed CNN step, {'synchronized' if a.sync_bn else 'per-rank'} BN, {a.transport}")
    ax.legend()
    common.save_plot(fig, a.plot)


def main():
    a = common.step_variants_args(__doc__, "step_breakdown", rounds=7)
    worker(a) if a.worker else driver(a)


if __name__ == "__main__":
    sys.exit(main())
