"""Where a training step's CPU time goes, thread by thread, at np = 1 and 2 (one core per rank).

    .venv/bin/python benchmarks/thread_time.py                 # seed CNN, per-rank BN, MPI
    .venv/bin/python benchmarks/thread_time.py --sync-bn       # with hvdtrain's SyncBatchNormalization

On CPU each rank has one core (under MPI, every thread of it; under Gloo, Horovod's threads keep
the launch's cores), so its step time is the CPU time of all its threads together whenever the
core never idles. This script reads each thread's Linux scheduler statistics
(``/proc/self/task/<tid>/schedstat``: nanoseconds run and nanoseconds waited runnable on the run
queue) around timed steps, in three groups:

* ``Python main``: the thread that calls the compiled step;
* ``Horovod``: the threads ``hvd.init`` starts (Horovod's background loop, MPI's or Gloo's helpers;
  nice 19 under MPI, see ``hvdtrain/runtime/placement.py``);
* ``TensorFlow``: every other thread, nearly all of them TensorFlow's inter-op and intra-op pools.

Variants, alternating in rounds within each job as in ``step_breakdown.py``: ``no collectives`` (the
plain optimizer), ``hvdtrain`` (the real step), and ``one group`` (every gradient in one grouped
allreduce after the backward pass). Jobs at np = 1 and 2 alternate ``--repeats`` times; each figure
is the median over jobs of the mean over ranks, and the scaling efficiency the median over repeats
of the repeat's own ratio. Prints a table and writes a PNG plot (stacked CPU time per step against
the step time).
"""
import os
import statistics
import sys
import time

import numpy as np

import common

GROUPS = ("Python main", "Horovod", "TensorFlow")
VARIANTS = ("no collectives", "hvdtrain", "one group")


def _thread_times() -> dict:
    """``{tid: (ns run, ns waited on the run queue)}`` of this process's threads (Linux schedstat)."""
    times = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run, wait, _ = map(int, f.read().split())
        except (FileNotFoundError, ProcessLookupError):  # the thread exited meanwhile
            continue
        times[int(tid)] = (run, wait)
    return times


def worker(a) -> None:
    from hvdtrain.runtime.dist import init_distributed

    ctx = init_distributed(threads=1, use_gpu=False)
    import tensorflow as tf

    from hvdtrain.model.zoo import norm_factory, seed_cnn

    dataset = common.bench_dataset("cnn", a.batch_size, ctx.size)

    def training_steps(variant):
        tf.keras.utils.set_random_seed(0)
        model = seed_cnn(dataset.input_shape, dataset.num_classes, norm=norm_factory(a.sync_bn))
        optimizer = {"hvdtrain": lambda: None, "one group": common.one_group_sgd,
                     "no collectives": lambda: tf.keras.optimizers.SGD(0.05, momentum=0.9)}[variant]()
        trainer, run = common.hvdtrain_stepper(ctx, model, dataset, a.batch_size, optimizer)
        if variant == "one group":
            common.check_grouped(trainer)
        return run

    runs = {variant: training_steps(variant) for variant in VARIANTS}
    for run in runs.values():
        run(a.warmup)  # tracing and allocation, untimed
    main = os.getpid()

    def group(tid):
        return "Python main" if tid == main else "Horovod" if tid in ctx.horovod_threads else "TensorFlow"

    totals = {v: {"step": 0.0, **{f"{g} {k}": 0.0 for g in GROUPS for k in ("run", "wait")}} for v in VARIANTS}
    for _ in range(a.rounds):
        for variant, run in runs.items():
            start_times, start = _thread_times(), time.perf_counter()
            run(a.steps)
            elapsed, end_times = time.perf_counter() - start, _thread_times()
            totals[variant]["step"] += elapsed
            for tid, (ran, waited) in end_times.items():
                ran0, waited0 = start_times.get(tid, (0, 0))
                totals[variant][f"{group(tid)} run"] += (ran - ran0) / 1e9
                totals[variant][f"{group(tid)} wait"] += (waited - waited0) / 1e9
    keys = list(totals[VARIANTS[0]])
    flat = [totals[v][k] * 1e3 / (a.rounds * a.steps) for v in VARIANTS for k in keys]  # ms per step
    mean = ctx.allreduce_sum(flat, "bench.thread_time") / ctx.size
    rss = common.gather_rss(ctx)
    if ctx.is_chief:
        result = {v: dict(zip(keys, mean[i * len(keys):(i + 1) * len(keys)].tolist())) for i, v in enumerate(VARIANTS)}
        common.write_result(a.result, {"np": ctx.size, "ms": result, "rss_mib": rss})
    ctx.close()


def driver(a) -> None:
    jobs = common.step_variant_jobs(__file__, a, lambda r: ", ".join(f"{v} {r['ms'][v]['step']:.2f} ms" for v in VARIANTS))
    ms = {np_: {v: {k: statistics.median(r["ms"][v][k] for r in runs) for k in runs[0]["ms"][v]} for v in VARIANTS}
          for np_, runs in jobs.items()}
    rows = []
    for np_ in jobs:
        for v in VARIANTS:
            m = ms[np_][v]
            cpu = sum(m[f"{g} run"] for g in GROUPS)
            rows.append([f"np={np_}", v, f"{m['step']:.2f}", *(f"{m[f'{g} run']:.2f}" for g in GROUPS),
                         f"{cpu:.2f}", f"{cpu / m['step']:.3f}", f"{m['Horovod wait']:.1f}"])
    common.print_table(["np", "variant", "step ms", *(f"{g} CPU ms" for g in GROUPS), "all threads CPU ms",
                        "CPU / step", "Horovod run-queue wait ms"], rows,
                       title=f"seed CNN, {'synchronized' if a.sync_bn else 'per-rank'} BN, local batch {a.batch_size}, "
                             f"{a.transport}, one core per rank; per step, median of {a.repeats} jobs per np")
    one, two = ms[1]["hvdtrain"], ms[2]["hvdtrain"]
    # Paired by repeat (jobs at np=1 and 2 alternate), as scaling.py's.
    efficiency = common.median_ratio([r["ms"]["hvdtrain"]["step"] for r in jobs[1]],
                                     [r["ms"]["hvdtrain"]["step"] for r in jobs[2]])
    common.print_table(["hvdtrain, np=2 against np=1", "ms/step"], [
        ["step time", f"{two['step'] - one['step']:+.2f}"],
        *[[f"{g} CPU", f"{two[f'{g} run'] - one[f'{g} run']:+.2f}"] for g in GROUPS],
        ["scaling efficiency (np=1 step / np=2 step)", f"{efficiency:.3f}"],
    ])
    common.print_job_rss(jobs)
    plt = common.matplotlib_pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"np={np_}\n{v}" for np_ in jobs for v in VARIANTS]
    bottom = np.zeros(len(labels))
    for g in GROUPS:
        heights = np.array([ms[np_][v][f"{g} run"] for np_ in jobs for v in VARIANTS])
        ax.bar(labels, heights, 0.6, bottom=bottom, label=f"{g} CPU")
        bottom += heights
    ax.plot(labels, [ms[np_][v]["step"] for np_ in jobs for v in VARIANTS], "k_", markersize=30, label="step time")
    ax.set(ylabel="ms per step (median)",
           title=f"CPU time per step by thread, seed CNN, {'synchronized' if a.sync_bn else 'per-rank'} BN, {a.transport}")
    ax.legend(fontsize=8)
    common.save_plot(fig, a.plot)


def main():
    a = common.step_variants_args(__doc__, "thread_time", rounds=5)
    worker(a) if a.worker else driver(a)


if __name__ == "__main__":
    sys.exit(main())
