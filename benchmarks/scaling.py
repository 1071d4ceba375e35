"""Training throughput and scaling efficiency of hvdtrain for np = 1 ... N ranks.

    .venv/bin/python benchmarks/scaling.py            # CPU: seed CNN + ResNet-20, np = 1..cores
    .venv/bin/python benchmarks/scaling.py --models resnet50 --gpu --mixed-precision --max-np 1 --repeats 1

For each model and each np, launches a job of np ranks (``horovodrun --gloo`` or ``mpirun``) that
times hvdtrain's real training step the way Horovod's ``tensorflow2_synthetic_benchmark.py`` does:
warm-up batches excluded, then ``--iters`` timed iterations of ``--batches-per-iter`` steps each;
images/s per rank is the mean over iterations +- 1.96 standard deviations, and the total is np times
that. ``--repeats`` runs of every np alternate (1, 2, ..., N, 1, 2, ...); each np shows its median
run. Scaling efficiency = total(np) / (np * total(1)), computed within each repeat (so both runs
saw the same spell of the shared machine) and reported as the median over repeats with its range.
On CPU the job of np ranks is confined to np cores, one per rank (hvdtrain pins each rank to its
share; under Gloo, Horovod's threads run on any of the np), so every np gets the same compute per rank. Each repeat of np > 1 on CPU also runs np copies
of the np=1 job at the same time, each on its own share of the cores, timed over the same span,
with no communication at all: their total over np times one job's is the *ceiling*, the scaling
this machine allows jobs that share nothing but the hardware (caches, memory bandwidth, the
hypervisor), and efficiency / ceiling is what the distributed step itself costs (each the median
over repeats of the repeat's own ratio; ``--no-ceiling`` skips it). Models: the seed CNN on real
Fashion-MNIST, ResNet-20 on 32x32 synthetic data, ResNet-50 on 224x224 synthetic data (for GPUs).
Prints a Markdown table and writes a PNG plot.
"""
import argparse
import os
import statistics
import sys

import common


def worker(a) -> None:
    from hvdtrain.runtime.dist import init_distributed

    from hvdtrain.errors import HvdtrainError

    ctx = init_distributed(threads=a.threads, use_gpu=a.gpu)
    # Every rank stops together (a rank leaving alone would leave the others in a collective).
    ctx.agree(HvdtrainError("--gpu: a rank sees no GPU (TensorFlow without CUDA, or CUDA_VISIBLE_DEVICES)")
              if a.gpu and ctx.device != "/GPU:0" else None, "finding a GPU")
    import tensorflow as tf

    if a.mixed_precision:
        tf.keras.mixed_precision.set_global_policy("mixed_bfloat16")
    dataset = common.bench_dataset(a.model, a.batch_size, ctx.size)
    tf.keras.utils.set_random_seed(0)
    with tf.device(ctx.device):
        model = common.build_bench_model(a.model, dataset, sync_bn=not a.no_sync_bn)
    _, run = common.hvdtrain_stepper(ctx, model, dataset, a.batch_size)
    img_secs = common.images_per_second(run, a.batch_size, a.warmup_batches, a.iters, a.batches_per_iter)
    mean, ci = common.mean_ci(img_secs)
    # Every rank's mean and interval, so the per-rank figures are not rank 0's alone.
    per_rank, ci = ctx.allreduce_sum([mean, ci], "bench.per_rank") / ctx.size
    rss = common.gather_rss(ctx)
    if ctx.is_chief:
        common.write_result(a.result, {"np": ctx.size, "per_rank": per_rank, "ci": ci, "rank0_mean": mean,
                                       "total": per_rank * ctx.size, "total_ci": ci * ctx.size,
                                       "threads": ctx.intra_op_threads, "device": ctx.device, "rss_mib": rss})
    ctx.close()


def _median_by(items, key):
    """The median item by ``key`` (for an even count, the lower of the two middle ones)."""
    return sorted(items, key=key)[(len(items) - 1) // 2]


def summarize(runs, base_runs, ceilings, np_: int) -> dict:
    """One np's figures over the repeats, each paired with the same repeat's np=1 run.

    ``runs`` and ``base_runs`` hold each repeat's job result at np and at np=1 (``"total"``: img/s);
    ``ceilings`` each repeat's summed img/s of np independent np=1 jobs (empty without them).
    Returns the median run by total, the median and range of the per-repeat scaling efficiencies
    total(np) / (np * total(1)), and, with ceilings, the same of ceiling / (np * total(1)) and the
    median of efficiency / ceiling. Ratios are taken within a repeat, then the median over repeats
    (not the ratio of medians), so that a slow spell of the machine hits both sides of each ratio.
    """
    efficiencies = [r["total"] / (np_ * base["total"]) for r, base in zip(runs, base_runs)]
    result = {"run": _median_by(runs, lambda r: r["total"]), "efficiency": statistics.median(efficiencies),
              "efficiency_range": (min(efficiencies), max(efficiencies))}
    if ceilings:
        per_repeat = [c / (np_ * base["total"]) for c, base in zip(ceilings, base_runs)]
        result.update(ceiling=statistics.median(per_repeat), ceiling_range=(min(per_repeat), max(per_repeat)),
                      of_ceiling=statistics.median(e / c for e, c in zip(efficiencies, per_repeat)))
    return result


def driver(a) -> None:
    cores = len(os.sched_getaffinity(0))
    max_np = a.max_np or (1 if a.gpu else max(1, cores // a.threads))
    if not a.gpu and max_np * a.threads > cores:  # refused before any job runs, not at the np that lacks them
        raise SystemExit(f"--max-np {max_np} with --threads {a.threads} needs {max_np * a.threads} cores, this "
                         f"machine gives {cores}")
    nps = list(range(1, max_np + 1))
    with_ceiling = not (a.gpu or a.no_ceiling)
    results = {}
    for model in a.models:
        args = ["--model", model, "--batch-size", str(a.batch_size), "--iters", str(a.iters),
                "--batches-per-iter", str(a.batches_per_iter), "--warmup-batches", str(a.warmup_batches),
                "--threads", str(a.threads)] + (["--gpu"] if a.gpu else []) + (
                ["--mixed-precision"] if a.mixed_precision else []) + (["--no-sync-bn"] if a.no_sync_bn else [])
        runs = {np_: [] for np_ in nps}
        ceilings = {np_: [] for np_ in nps}  # per repeat: summed img/s of np independent np=1 jobs
        # Repeats alternate np = 1..N, so a slow spell of the shared machine hits every np alike;
        # each np is then represented by its run with the median total.
        single = "single" if a.transport == "gloo" else a.transport  # how the np=1 job is launched
        for repeat in range(a.repeats):
            for np_ in nps:
                cores = None if a.gpu else common.cores_for(np_ * max(1, a.threads))
                r = common.run_job(np_, __file__, args, single if np_ == 1 else a.transport, cores=cores)
                runs[np_].append(r)
                print(f"{model} np={np_} (repeat {repeat + 1}/{a.repeats}): {r['per_rank']:.1f} img/s per rank, "
                      f"total {r['total']:.1f} +-{r['total_ci']:.1f}", flush=True)
                if with_ceiling and np_ > 1:
                    # np copies of the np=1 job at once, each confined to its own share of the cores.
                    share = [cores[i * a.threads:(i + 1) * a.threads] for i in range(np_)]
                    concurrent = common.run_jobs_at_once([(1, c) for c in share], __file__, args, single)
                    ceilings[np_].append(sum(j["total"] for j in concurrent))
                    print(f"{model} {np_} independent np=1 jobs at once (repeat {repeat + 1}/{a.repeats}): "
                          + ", ".join(f"{j['total']:.1f}" for j in concurrent) + " img/s", flush=True)
        for np_ in nps:
            results[(model, np_)] = summarize(runs[np_], runs[1], ceilings[np_], np_)
    rows = []
    for model in a.models:
        for np_ in nps:
            result = results[(model, np_)]
            r = result["run"]
            low, high = result["efficiency_range"]
            row = [model, np_, f"{r['per_rank']:.1f} +-{r['ci']:.1f}", f"{r['total']:.1f} +-{r['total_ci']:.1f}",
                   f"{result['efficiency']:.3f} ({low:.3f}-{high:.3f})"]
            if with_ceiling:
                row += ([f"{result['ceiling']:.3f} ({result['ceiling_range'][0]:.3f}-{result['ceiling_range'][1]:.3f})",
                         f"{result['of_ceiling']:.3f}"] if "ceiling" in result else ["", ""])
            rows.append(row + [" / ".join(f"{m:.0f}" for m in r["rss_mib"])])
    common.print_table(["model", "np", "img/s per rank", "img/s total", "scaling efficiency (range)"]
                       + (["ceiling, no communication (range)", "efficiency / ceiling (median)"] if with_ceiling
                          else [])
                       + ["peak RSS per rank MiB"],
                       rows, title=f"hvdtrain training throughput ({a.transport}, local batch {a.batch_size}, "
                                   f"{'GPU' if a.gpu else f'{a.threads} core(s) per rank'}, "
                                   f"median of {a.repeats} repeats)")
    plt = common.matplotlib_pyplot()
    fig, axes = plt.subplots(1, len(a.models), figsize=(5 * len(a.models), 4), squeeze=False)
    for ax, model in zip(axes[0], a.models):
        totals = [results[(model, n)]["run"]["total"] for n in nps]
        cis = [results[(model, n)]["run"]["total_ci"] for n in nps]
        ax.errorbar(nps, totals, yerr=cis, marker="o", capsize=4, label="hvdtrain (median run; labels: median efficiency)")
        ax.plot(nps, [totals[0] * n for n in nps], "--", color="gray", label="linear")
        if with_ceiling:
            ax.plot(nps, [totals[0] * n * results[(model, n)].get("ceiling", 1.0) for n in nps], ":", marker="s",
                    color="tab:green", label="np independent np=1 jobs (ceiling, no communication)")
        for n, t in zip(nps, totals):
            ax.annotate(f"{results[(model, n)]['efficiency']:.2f}", (n, t), textcoords="offset points",
                        xytext=(6, -12))
        ax.set(title=f"{model}, local batch {a.batch_size}", xlabel="ranks (np)", ylabel="images/s (total)",
               xticks=nps)
        ax.legend()
    common.save_plot(fig, a.plot)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["cnn", "resnet20"], choices=sorted(common.IMAGE_SHAPES))
    p.add_argument("--model", default="cnn", help=argparse.SUPPRESS)
    p.add_argument("--max-np", type=int, default=0, help="largest np (default: cores on CPU, 1 on GPU)")
    p.add_argument("--transport", default="gloo", choices=["gloo", "mpi"])
    p.add_argument("--batch-size", type=common.positive_int, default=128, help="local batch per rank")
    p.add_argument("--warmup-batches", type=common.positive_int, default=10)
    p.add_argument("--iters", type=common.positive_int, default=10)
    p.add_argument("--batches-per-iter", type=common.positive_int, default=10)
    p.add_argument("--repeats", type=common.positive_int, default=3, help="alternating runs of every np (median taken)")
    p.add_argument("--threads", type=common.positive_int, default=1, help="intra-op threads per rank (CPU)")
    p.add_argument("--gpu", action="store_true", help="one GPU per rank instead of one core per rank")
    p.add_argument("--mixed-precision", action="store_true", help="mixed_bfloat16 Keras policy")
    p.add_argument("--no-sync-bn", action="store_true", help="per-rank BatchNorm in the CNN and ResNet-20")
    p.add_argument("--no-ceiling", action="store_true",
                   help="skip the np independent np=1 jobs run at once (the ceiling without communication; CPU)")
    p.add_argument("--plot", default=None, help="PNG path (default: benchmarks/figures/scaling_<mpi|gloo|gpu>.png)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    a.plot = a.plot or os.path.join(common.REPO, "benchmarks", "figures", f"scaling_{'gpu' if a.gpu else a.transport}.png")
    worker(a) if a.worker else driver(a)


if __name__ == "__main__":
    sys.exit(main())
