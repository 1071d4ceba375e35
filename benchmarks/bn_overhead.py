"""Step time of local BatchNorm vs hvdtrain's SyncBatchNormalization vs Horovod's, side by side.

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/bn_overhead.py [--models cnn resnet20]

For each model, builds three copies that differ only in their batch norm layer, then times rounds
of training steps alternating between them (so machine noise hits all three alike). Rank 0 prints
a Markdown table of median step times and their ratios, and plots the ratios to local BatchNorm
(``--plot``). Every step is hvdtrain's real compiled training step (gather, forward, backward,
gradient allreduce, SGD update).
"""
import argparse
import functools
import json

import common
from hvdtrain.dist import init_distributed


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["cnn", "resnet20"], choices=["cnn", "resnet20"])
    p.add_argument("--batch-size", type=common.positive_int, default=128, help="local batch per rank")
    p.add_argument("--rounds", type=common.positive_int, default=7, help="alternating rounds (median over them)")
    p.add_argument("--steps", type=common.positive_int, default=10, help="steps per variant per round")
    p.add_argument("--warmup", type=common.positive_int, default=5, help="untimed steps per variant first (tracing)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--plot", default=str(common.REPO / "benchmarks" / "figures" / "bn_overhead.png"))
    a = p.parse_args()

    ctx = init_distributed()
    import tensorflow as tf
    from hvdtrain.data import make_synthetic
    from hvdtrain.models import norm_factory, resnet20, seed_cnn

    variants = {"local": norm_factory(False), "hvdtrain": norm_factory(True), "horovod": common.horovod_sync_bn}
    shapes = {"cnn": (28, 28, 1), "resnet20": (32, 32, 3)}
    builders = {"cnn": functools.partial(seed_cnn, dropout=0.0), "resnet20": resnet20}
    results = {}
    for model_name in a.models:
        data = make_synthetic(num_train=a.batch_size * ctx.size * 4, num_test=10, image_shape=shapes[model_name])
        runs = {}
        for variant, norm in variants.items():
            tf.keras.utils.set_random_seed(0)
            model = builders[model_name](data.input_shape, data.num_classes, norm=norm)
            runs[variant] = common.hvdtrain_stepper(ctx, model, data, a.batch_size)[1]
        medians = common.alternating_step_times(ctx, runs, a.warmup, a.rounds, a.steps)
        results[model_name] = medians
        if ctx.is_chief:
            base = medians["local"]
            print(f"{model_name} np={ctx.size} local batch {a.batch_size}: " + "  ".join(
                f"{v} {t * 1e3:.2f} ms ({t / base:.3f}x)" for v, t in medians.items()), flush=True)
    rss = common.gather_rss(ctx)
    if ctx.is_chief:
        names = {"cnn": "seed CNN", "resnet20": "ResNet-20"}
        rows = [[names[model_name], *(f"{m[v] * 1e3:.2f}" for v in ("local", "hvdtrain", "horovod")),
                 m["hvdtrain"] / m["local"], m["hvdtrain"] / m["horovod"]] for model_name, m in results.items()]
        common.print_table(
            ["model", "local BN ms", "hvdtrain ms", "Horovod's ms", "hvdtrain / local", "hvdtrain / Horovod's"], rows,
            title=f"np={ctx.size}, local batch {a.batch_size}; median step time over {a.rounds} alternating rounds "
                  f"of {a.steps} steps (targets: hvdtrain / local <= 1.05, hvdtrain / Horovod's <= 1)")
        print("peak RSS per rank (MiB, every model and variant in one process): " + ", ".join(f"{r:.0f}" for r in rss))
        to_local = [{v: t / m["local"] for v, t in m.items()} for m in results.values()]
        common.grouped_bars(a.plot, [row[0] for row in rows],
                            {label: [r[v] for r in to_local]
                             for v, label in (("local", "local BN"), ("hvdtrain", "hvdtrain"), ("horovod", "Horovod's"))},
                            ylabel="step time / local BatchNorm's",
                            title=f"synchronized BatchNorm, np={ctx.size}, local batch {a.batch_size}", target=1.05)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"world_size": ctx.size, "batch_size": a.batch_size, "step_time_s": results, "rss_mib": rss},
                          f, indent=1)
    ctx.close()


if __name__ == "__main__":
    main()
