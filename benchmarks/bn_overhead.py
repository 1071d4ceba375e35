"""Step time of local BatchNorm vs hvdtrain's SyncBatchNormalization vs Horovod's, side by side.

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/bn_overhead.py [--models cnn resnet20]

For each model, builds one copy per variant that differ only in their batch norm layer (and where
the ReLU after it runs), then times rounds of training steps alternating between them in the order
given (so machine noise hits every variant alike). Rank 0 prints a Markdown table of median step
times and hvdtrain's ratio to each other variant (the median of the rounds' own ratios), and
plots the step times relative to local BatchNorm (``--plot``). Every step is hvdtrain's real
compiled training step (gather, forward, backward, gradient allreduce, SGD update).

Variants: ``local`` (Keras BatchNormalization, per rank), ``hvdtrain`` (hvdtrain's layer, ReLU
fused, as in the built-in models), ``horovod`` (``hvd.SyncBatchNormalization``), ``relu-apart``
(hvdtrain's layer with the ReLU as a layer of its own: what the fusion saves) and ``per-rank``
(hvdtrain's layer with ``synchronized=False``, as ``--no-sync-bn`` builds it).
"""
import argparse
import functools
import json

import common
from hvdtrain.runtime.dist import init_distributed

# variant -> (column label, label in ratio columns)
VARIANTS = {"local": ("local BN", "local"), "hvdtrain": ("hvdtrain", "hvdtrain"),
            "horovod": ("Horovod's", "Horovod's"), "relu-apart": ("hvdtrain, ReLU apart", "ReLU apart"),
            "per-rank": ("hvdtrain per-rank", "hvdtrain per-rank")}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["cnn", "resnet20"], choices=["cnn", "resnet20"])
    p.add_argument("--variants", nargs="+", default=["local", "hvdtrain", "horovod"], choices=list(VARIANTS),
                   help="what to time, in this order within each round, reversed every other round "
                        "(must include hvdtrain)")
    p.add_argument("--batch-size", type=common.positive_int, default=128, help="local batch per rank")
    p.add_argument("--rounds", type=common.positive_int, default=7, help="alternating rounds (median over them)")
    p.add_argument("--steps", type=common.positive_int, default=10, help="steps per variant per round")
    p.add_argument("--warmup", type=common.positive_int, default=5, help="untimed steps per variant first (tracing)")
    p.add_argument("--threads", type=common.positive_int, default=1,
                   help="TensorFlow intra-op threads per rank (default 1, as every other benchmark here)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--plot", default=str(common.REPO / "benchmarks" / "figures" / "bn_overhead.png"))
    a = p.parse_args()
    if "hvdtrain" not in a.variants or len(set(a.variants)) != len(a.variants) or len(a.variants) < 2:
        p.error(f"argument --variants: give hvdtrain and at least one other variant, each once; got {' '.join(a.variants)}")

    ctx = init_distributed(threads=a.threads)
    import tensorflow as tf
    from hvdtrain.keras2 import SyncBatchNormalization
    from hvdtrain.data.in_memory import make_synthetic
    from hvdtrain.model.zoo import norm_factory, resnet20, seed_cnn, unfused_norm

    norms = {"local": common.keras_batch_norm, "hvdtrain": norm_factory(True), "horovod": common.horovod_sync_bn,
             "relu-apart": unfused_norm(functools.partial(SyncBatchNormalization, momentum=0.9)),
             "per-rank": norm_factory(False)}
    others = [v for v in a.variants if v != "hvdtrain"]
    shapes = {"cnn": (28, 28, 1), "resnet20": (32, 32, 3)}
    builders = {"cnn": functools.partial(seed_cnn, dropout=0.0), "resnet20": resnet20}
    results = {}
    for model_name in a.models:
        data = make_synthetic(num_train=a.batch_size * ctx.size * 4, num_test=10, image_shape=shapes[model_name])
        runs = {}
        for variant in a.variants:
            tf.keras.utils.set_random_seed(0)
            model = builders[model_name](data.input_shape, data.num_classes, norm=norms[variant])
            runs[variant] = common.hvdtrain_stepper(ctx, model, data, a.batch_size)[1]
        results[model_name] = common.alternating_step_times(ctx, runs, a.warmup, a.rounds, a.steps)
        if ctx.is_chief:
            print(f"{model_name} np={ctx.size} local batch {a.batch_size}: " + "  ".join(
                f"{v} {t * 1e3:.2f} ms" for v, t in results[model_name].medians().items()), flush=True)
    rss = common.gather_rss(ctx)
    if ctx.is_chief:
        names = {"cnn": "seed CNN", "resnet20": "ResNet-20"}
        # hvdtrain's layer against each other variant, and its per-rank mode against Keras' layer.
        pairs = [("hvdtrain", v) for v in others] + (
            [("per-rank", "local")] if {"per-rank", "local"} <= set(a.variants) else [])
        rows = [[names[model_name], *(f"{times.median(v) * 1e3:.2f}" for v in a.variants),
                 *(times.ratio(x, y) for x, y in pairs)] for model_name, times in results.items()]
        common.print_table(
            ["model", *(f"{VARIANTS[v][0]} ms" for v in a.variants),
             *(f"{VARIANTS[x][1]} / {VARIANTS[y][1]}" for x, y in pairs)],
            rows, title=f"np={ctx.size}, local batch {a.batch_size}; {a.rounds} alternating rounds of {a.steps} steps: "
                        f"median step times, and the median of the rounds' ratios (targets: hvdtrain / local <= 1.05, "
                        f"hvdtrain / Horovod's <= 1)")
        print("peak RSS per rank (MiB, every model and variant in one process): " + ", ".join(f"{r:.0f}" for r in rss))
        base = "local" if "local" in a.variants else "hvdtrain"
        common.grouped_bars(a.plot, [row[0] for row in rows],
                            {VARIANTS[v][0]: [times.ratio(v, base) for times in results.values()] for v in a.variants},
                            ylabel=f"step time / {VARIANTS[base][0]}'s",
                            title=f"batch norm layers, np={ctx.size}, local batch {a.batch_size}",
                            target=1.05 if base == "local" else None)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"world_size": ctx.size, "batch_size": a.batch_size,
                           "step_time_s": {m: times.medians() for m, times in results.items()},
                           "round_step_times_s": {m: times.samples for m, times in results.items()},
                           "rss_mib": rss}, f, indent=1)
    ctx.close()


if __name__ == "__main__":
    main()
