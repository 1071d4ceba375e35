"""Where the gradient allreduce's time goes inside hvdtrain's step, phase by phase (Horovod timeline).

    .venv/bin/python benchmarks/allreduce_phases.py                        # seed CNN, per-rank BN, np=2, MPI
    .venv/bin/python benchmarks/allreduce_phases.py --single-copy none cma --repeats 3   # both mechanisms

Runs np=2 jobs over MPI (one core per rank) of the seed CNN's real training step, and records
Horovod's timeline (``HOROVOD_TIMELINE=DYNAMIC``, ``hvd.start_timeline``) around ``--steps`` timed
steps. Every gradient's allreduce passes through Horovod's phases:

* ``NEGOTIATE_ALLREDUCE``: from the background loop's cycle in which the first rank has enqueued
  the gradient to the cycle in which every rank has. With the response cache it resolves whole
  cycles (``HOROVOD_CYCLE_TIME``, 0.1 ms under hvdtrain).
* one fused ``ALLREDUCE``, made of ``MEMCPY_IN_FUSION_BUFFER``, ``MPI_ALLREDUCE`` and
  ``MEMCPY_OUT_FUSION_BUFFER``.

For each OpenMPI single-copy mechanism (``btl_vader_single_copy_mechanism``: ``none`` copies in and
out through shared memory, the benchmarks' default because containers often forbid ``cma``,
cross-memory attach, which is OpenMPI's own default where it is allowed), prints the median of each
phase over gradient tensors, the time per step during which some gradient is in its ``ALLREDUCE``
(the union of those spans), and the step time (timed with the timeline on, mean over ranks). A
phase that never occurs shows as nan (without fusion there are no fusion-buffer copies). Jobs of
the mechanisms alternate ``--repeats`` times; figures are medians over jobs. Prints a table and
peak RSS per rank, and writes a PNG plot.
"""
import argparse
import collections
import json
import statistics
import tempfile
import time

import common

PHASES = ("NEGOTIATE_ALLREDUCE", "MEMCPY_IN_FUSION_BUFFER", "MPI_ALLREDUCE", "MEMCPY_OUT_FUSION_BUFFER", "ALLREDUCE")


def phase_spans(path: str) -> dict:
    """``{phase: [(tensor id, start us, end us), ...]}`` from a Horovod timeline (Chrome trace JSON,
    one ``B``/``E`` pair per phase per tensor, tensors as ``pid``). A timeline stopped while Horovod
    runs may lack its closing bracket; it is added."""
    with open(path) as f:
        text = f.read().rstrip().rstrip(",")
    events = json.loads(text if text.endswith("]") else text + "]")
    open_phases, spans = collections.defaultdict(list), collections.defaultdict(list)
    for event in events:
        if event.get("ph") == "B":
            open_phases[event["pid"]].append((event["name"], event["ts"]))
        elif event.get("ph") == "E" and open_phases[event["pid"]]:
            name, start = open_phases[event["pid"]].pop()
            spans[name].append((event["pid"], start, event["ts"]))
    return spans


def worker(a) -> None:
    from hvdtrain.runtime.dist import init_distributed

    ctx = init_distributed(threads=1, use_gpu=False)
    import horovod.tensorflow as hvd
    import tensorflow as tf

    dataset = common.bench_dataset("cnn", a.batch_size, ctx.size)
    tf.keras.utils.set_random_seed(0)
    model = common.build_bench_model("cnn", dataset, sync_bn=False)
    _, run = common.hvdtrain_stepper(ctx, model, dataset, a.batch_size)
    run(a.warmup)
    hvd.start_timeline(a.timeline)
    start = time.perf_counter()
    run(a.steps)
    step_ms = (time.perf_counter() - start) / a.steps * 1e3
    hvd.stop_timeline()
    step_ms = ctx.allreduce_sum([step_ms], "bench.step_ms")[0] / ctx.size
    rss = common.gather_rss(ctx)
    if ctx.is_chief:
        common.write_result(a.result, {"step_ms": step_ms, "rss_mib": rss})
    ctx.close()


def summarize(timeline: str, steps: int) -> dict:
    """Median µs of each phase, and the µs per step during which some gradient is in its
    ``ALLREDUCE``, from one job's timeline."""
    spans = phase_spans(timeline)
    out = {phase: statistics.median(end - start for _, start, end in spans[phase]) if spans[phase] else float("nan")
           for phase in PHASES}
    # Tensors fused together each have an ALLREDUCE span, overlapping: time the union of the spans.
    busy, reach = 0, None
    for start, end in sorted((start, end) for _, start, end in spans["ALLREDUCE"]):
        if reach is None or start > reach:
            busy, reach = busy + end - start, end
        elif end > reach:
            busy, reach = busy + end - reach, end
    out["ALLREDUCE per step"] = busy / steps
    return out


def driver(a) -> None:
    results = {m: [] for m in a.single_copy}
    for repeat in range(a.repeats):
        for mechanism in a.single_copy:
            with tempfile.TemporaryDirectory() as tmp:
                timeline = f"{tmp}/timeline.json"
                r = common.run_job(2, __file__, ["--batch-size", str(a.batch_size), "--steps", str(a.steps),
                                                 "--warmup", str(a.warmup), "--timeline", timeline],
                                   "mpi", cores=common.cores_for(2),
                                   env={"HOROVOD_TIMELINE": "DYNAMIC",
                                        "OMPI_MCA_btl_vader_single_copy_mechanism": mechanism})
                r.update(summarize(timeline, a.steps))
            results[mechanism].append(r)
            print(f"{mechanism} (repeat {repeat + 1}/{a.repeats}): step {r['step_ms']:.2f} ms, "
                  f"MPI_ALLREDUCE {r['MPI_ALLREDUCE']:.0f} us, allreduce busy per step "
                  f"{r['ALLREDUCE per step']:.0f} us", flush=True)
    columns = ["step_ms", *PHASES, "ALLREDUCE per step"]
    rows = [[m] + [f"{statistics.median(r[c] for r in runs):.{2 if c == 'step_ms' else 0}f}" for c in columns]
            for m, runs in results.items()]
    common.print_table(["single copy", "step ms", *(f"{p} us" for p in PHASES), "allreduce busy per step us"], rows,
                       title=f"seed CNN, per-rank BN, np=2, MPI, local batch {a.batch_size}, one core per rank; "
                             f"medians over tensors, then over {a.repeats} job(s)")
    print("peak RSS per rank (MiB, last job): " + "; ".join(
        f"{m}: " + ", ".join(f"{r:.0f}" for r in runs[-1]["rss_mib"]) for m, runs in results.items()))
    plt = common.matplotlib_pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    copies = ("MEMCPY_IN_FUSION_BUFFER", "MPI_ALLREDUCE", "MEMCPY_OUT_FUSION_BUFFER")
    bottom = [0.0] * len(results)
    for phase in ("NEGOTIATE_ALLREDUCE", *copies):
        heights = [statistics.median(r[phase] for r in runs) for runs in results.values()]
        ax.bar(list(results), heights, bottom=bottom, label=phase)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set(title="gradient allreduce phases in the step (np=2, MPI)", xlabel="btl_vader_single_copy_mechanism",
           ylabel="median us per gradient tensor")
    ax.legend(fontsize=8)
    common.save_plot(fig, a.plot)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--single-copy", nargs="+", default=["none"], choices=["none", "cma"],
                   help="OpenMPI btl_vader_single_copy_mechanism values to compare (cma fails where "
                        "cross-memory attach is forbidden)")
    p.add_argument("--batch-size", type=common.positive_int, default=128, help="local batch per rank")
    p.add_argument("--steps", type=common.positive_int, default=60, help="timed steps per job")
    p.add_argument("--warmup", type=common.positive_int, default=30, help="untimed steps first (tracing, warm-up)")
    p.add_argument("--repeats", type=common.positive_int, default=2, help="jobs per mechanism, alternating")
    p.add_argument("--plot", default=str(common.REPO / "benchmarks" / "figures" / "allreduce_phases.png"),
                   help="PNG path")
    p.add_argument("--timeline", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    a.single_copy = list(dict.fromkeys(a.single_copy))
    worker(a) if a.worker else driver(a)


if __name__ == "__main__":
    main()
