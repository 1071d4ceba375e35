"""The gradient exchange: hvdtrain's against Horovod's two, bytes sent per step and step time, side by side.

    .venv/bin/python benchmarks/exchange.py --launch 2                 # np=2 over Gloo
    .venv/bin/python benchmarks/exchange.py --launch 2 --memory        # each variant alone: peak RSS
    .venv/bin/python benchmarks/exchange.py --bytes-model              # bytes on paper, np = 8 to 512, and a plot

Three models, each trained by one plain ``tf.function`` step (forward, backward, exchange, Keras 3
SGD update) whose exchange is the variant, timed in alternating rounds in the same processes:

* recommender: two 1,000,000 x 64 embedding tables (``--table-rows``), 26 ids per example in each, drawn from
  Zipf(1.1) (numpy's ``zipf``, folded into the table), mean-pooled, two dense layers, local batch 512;
* text model: a Transformer block on 32-token sequences whose 32,000 x 256 input embedding is also its
  output projection (tied), next-token loss, local batch 16;
* the seed CNN (Fashion-MNIST, hvdtrain's step): Horovod's allreduce of each tensor, fused by timing
  (Horovod's default), against hvdtrain's fixed buckets.

The ranks run with Horovod's own ``HOROVOD_DISABLE_GROUP_FUSION=0`` (unless it is set), so that
Horovod's variants are fused as Horovod's users get them: hvdtrain's default ``1`` would make each of
their tensors a group fused alone. What hvdtrain's ``1`` costs its own training is
``deterministic.py``'s column "fused by timing".

Variants: ``horovod allgather`` (``hvd.DistributedGradientTape``'s default for an ``IndexedSlices``),
``horovod sparse_as_dense`` (a dense allreduce of each table), ``hvdtrain`` (:mod:`hvdtrain.exchange`).
Bytes are what each rank sends per step by the ring's formulas (:func:`hvdtrain.exchange.sparse_bytes`,
:func:`~hvdtrain.exchange.dense_bytes`): Horovod's allgather sends every id of the batch, duplicates
included; hvdtrain's counts the unique rows of the step it ran. ``--memory`` runs each variant in a
process of its own and prints its ranks' peak RSS (a dense table-sized gradient shows there).
"""
import argparse
import sys

import numpy as np

import common

TABLE_ROWS, TABLE_DIM, IDS_PER_EXAMPLE = 1_000_000, 64, 26
VOCAB, WIDTH, SEQUENCE = 32_000, 256, 32
VARIANTS = ("horovod allgather", "horovod sparse_as_dense", "hvdtrain")


def recommender(keras, table_rows: int):
    """Two tables, each a (26,) id input, mean-pooled, concatenated, two dense layers, a click logit."""
    inputs = [keras.Input((IDS_PER_EXAMPLE,), dtype="int32", name=f"ids{k}") for k in range(2)]
    pooled = [keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(table_rows, TABLE_DIM)(x)) for x in inputs]
    h = keras.layers.Dense(64, activation="relu")(keras.layers.Concatenate()(pooled))
    return keras.Model(inputs, keras.layers.Dense(1)(h))


def zipf_ids(rng, shape, table_rows: int = TABLE_ROWS):
    """Zipf(1.1) ids folded into the table (its heavy tail is long: most draws are small ids)."""
    return ((rng.zipf(1.1, size=shape) - 1) % table_rows).astype(np.int32)


def tied_language_model(keras):
    """Token ids ``(b, SEQUENCE)`` -> next-token logits ``(b, SEQUENCE, VOCAB)``: one Transformer block
    (Vaswani et al. 2017) between an embedding and its transpose as the output projection."""

    class TiedLanguageModel(keras.Model):
        def __init__(self):
            super().__init__()
            self.embedding = keras.layers.Embedding(VOCAB, WIDTH)
            self.attention = keras.layers.MultiHeadAttention(4, WIDTH // 4)
            self.norms = [keras.layers.LayerNormalization() for _ in range(2)]
            self.feed_forward = keras.Sequential([keras.layers.Dense(4 * WIDTH, activation="relu"),
                                                  keras.layers.Dense(WIDTH)])

        def call(self, ids, training=False):
            h = self.embedding(ids)
            h = self.norms[0](h + self.attention(h, h, use_causal_mask=True, training=training))
            h = self.norms[1](h + self.feed_forward(h))
            return keras.ops.matmul(h, keras.ops.transpose(self.embedding.embeddings))  # the tied projection

    model = TiedLanguageModel()
    model(np.zeros((1, SEQUENCE), np.int32))  # builds the variables
    return model


def exchanges(hvd):
    """``{variant: (tape, loss, variables) -> gradients over ranks}``."""
    from hvdtrain.exchange import Exchange

    ours = Exchange()
    return {"horovod allgather": lambda tape, loss, v: hvd.DistributedGradientTape(tape).gradient(loss, v),
            "horovod sparse_as_dense": lambda tape, loss, v: hvd.DistributedGradientTape(
                tape, sparse_as_dense=True).gradient(loss, v),
            "hvdtrain": lambda tape, loss, v: ours(tape.gradient(loss, v))}, ours


def plain_step(model, loss_fn, exchange, keras, choices=lambda: []):
    """``step(x, y) -> (loss, choices)``: forward, backward, ``exchange``, SGD update (Keras 3's sparse
    update of a table); ``choices()``, read after the exchange, is what the step also returns."""
    import tensorflow as tf

    optimizer = keras.optimizers.SGD(0.01)
    optimizer.build(model.trainable_variables)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        optimizer.apply(exchange(tape, loss, model.trainable_variables), model.trainable_variables)
        return loss, choices()

    return step


def runner(step, batches):
    def run(n):
        loss = None
        for _ in range(n):
            loss, _ = step(*next(batches))
        loss.numpy()
    return run


def bytes_per_step(world_size, variant, model, ids_per_rank, unique_rows, table_rows):
    """Each rank's bytes sent in one step: dense gradients ring-allreduced; the recommender's tables
    (``table_rows`` rows) as the variant sends them."""
    from hvdtrain.exchange import dense_bytes, sparse_bytes, table_bytes

    tables = [v for v in model.trainable_variables if v.shape[0] == table_rows]
    dense = sum(dense_bytes(world_size, 1, int(np.prod(v.shape)), 4) for v in model.trainable_variables
                if v.shape[0] != table_rows)
    for k, table in enumerate(tables):
        dim = int(table.shape[1])
        if variant == "horovod allgather":
            dense += sparse_bytes(world_size, world_size * ids_per_rank, dim, 4, 4)
        elif variant == "horovod sparse_as_dense":
            dense += dense_bytes(world_size, int(table.shape[0]), dim, 4)
        else:
            dense += min(sparse_bytes(world_size, unique_rows[k], dim, 4, 8),
                         table_bytes(world_size, int(table.shape[0]), dim, 4))
    if variant == "hvdtrain" and tables:  # the allreduce of the tables' row counts that decides
        dense += dense_bytes(world_size, 1, len(tables), 8)
    return dense


def worker(a) -> None:
    from hvdtrain.runtime.dist import init_distributed

    common.horovods_own_fusion()  # Horovod's baselines fused as Horovod's users get them
    ctx = init_distributed(threads=a.threads)
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    variants = VARIANTS if a.only is None else (a.only,)
    rows = []
    for name in a.models:
        keras.utils.set_random_seed(0)
        rng = np.random.default_rng(ctx.rank)
        if name == "recommender":
            model = recommender(keras, a.table_rows)
            loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)
            data = [((tf.constant(zipf_ids(rng, (a.batch_size, IDS_PER_EXAMPLE), a.table_rows)),
                      tf.constant(zipf_ids(rng, (a.batch_size, IDS_PER_EXAMPLE), a.table_rows))),
                     tf.constant(rng.integers(0, 2, (a.batch_size, 1)).astype(np.float32))) for _ in range(8)]
        elif name == "text":
            model = tied_language_model(keras)
            loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            tokens = [rng.integers(0, VOCAB, (16, SEQUENCE + 1)).astype(np.int32) for _ in range(8)]
            data = [(tf.constant(t[:, :-1]), tf.constant(t[:, 1:])) for t in tokens]
        elif a.only is None:
            rows += seed_cnn_rows(ctx, a)
            continue
        else:  # --memory: the seed CNN's two variants are alike in memory
            continue
        fns, ours = exchanges(hvd)
        runs, steps = {}, {}
        for variant in variants:
            steps[variant] = plain_step(model, loss_fn, fns[variant], keras,
                                        (lambda: list(ours.choices)) if variant == "hvdtrain" else (lambda: []))
            runs[variant] = runner(steps[variant], iter(data * 10 ** 6))
        times = common.alternating_step_times(ctx, runs, a.warmup, a.rounds, a.steps)
        # Unique rows of all ranks together, each table, the mean over the batches cycled through.
        unique = [float(np.mean(ctx.allreduce_sum([len(np.unique(x[k].numpy())) for x, _ in data],
                                                  f"bench.unique{k}"))) for k in range(2)] if name == "recommender" else []
        ids = a.batch_size * IDS_PER_EXAMPLE if name == "recommender" else 16 * SEQUENCE
        chosen = ", ".join("allgather" if bool(c) else "dense"
                           for c in steps["hvdtrain"](*data[0])[1]) if "hvdtrain" in steps else ""
        for variant in variants:
            sent = bytes_per_step(ctx.size, variant, model, ids, unique, a.table_rows if unique else None)
            rows.append([name, variant, sent / 2 ** 20,
                         times.median(variant) * 1e3, times.ratio(variant, variants[0])])
        if ctx.is_chief and chosen:
            print(f"{name}: hvdtrain's choices per table: {chosen}", flush=True)
    rss = common.gather_rss(ctx)
    if ctx.is_chief:
        common.print_table(["model", "exchange", "MiB sent per rank per step", "ms/step", "/ the model's first row"], rows,
                           title=f"np={ctx.size} over {'MPI' if hvd.mpi_enabled() else 'Gloo'}; {a.rounds} "
                                 f"alternating rounds of {a.steps} steps, median step times and the median of "
                                 f"the rounds' ratios")
        print(f"peak RSS per rank (MiB; {', '.join(variants)} in one process): "
              + ", ".join(f"{r:.0f}" for r in rss))
        common.write_result(a.result, {"rows": rows, "rss_mib": rss})
    ctx.close()


def seed_cnn_rows(ctx, a):
    """hvdtrain's step on the seed CNN with Horovod's own allreduce of each gradient against hvdtrain's buckets."""
    import horovod.tensorflow as hvd
    import tensorflow as tf
    from hvdtrain import kerases
    from hvdtrain.config import OptimConfig
    from hvdtrain.data.sharding import ShardPlan
    from hvdtrain.exchange import dense_bytes
    from hvdtrain.optim import build_optimizer

    dataset = common.bench_dataset("cnn", 128, ctx.size)
    runs, models = {}, {}
    for variant in ("horovod (each tensor, fused by timing)", "hvdtrain (fixed buckets)"):
        tf.keras.utils.set_random_seed(0)
        model = common.build_bench_model("cnn", dataset)
        plan = ShardPlan(len(dataset.y_train), 128, ctx.size, ctx.rank)
        optimizer, _ = build_optimizer(OptimConfig(warmup_epochs=0), ctx.size, plan.steps_per_epoch, 100,
                                       keras=kerases.module(kerases.version_of(model)))
        if variant.startswith("horovod"):  # Horovod's own exchange, as hvd.DistributedOptimizer makes it
            optimizer._allreduce_grads = hvd._make_allreduce_grads_fn(  # pylint: disable=protected-access
                "DistributedSGD", "", "", hvd.Compression.none, False, hvd.Average, 1.0, None,
                process_set=hvd.global_process_set)
        _, runs[variant] = common.hvdtrain_stepper(ctx, model, dataset, 128, optimizer=optimizer)
        models[variant] = model
    times = common.alternating_step_times(ctx, runs, a.warmup, a.rounds, a.steps)
    first = next(iter(runs))
    sent = sum(dense_bytes(ctx.size, 1, int(np.prod(v.shape)), 4) for v in models[first].trainable_variables)
    return [["seed CNN", v, sent / 2 ** 20, times.median(v) * 1e3, times.ratio(v, first)] for v in runs]


def bytes_model(path: str) -> None:
    """Bytes per rank per step on paper for np = 8 to 512: the recommender's two tables, each way."""
    from hvdtrain.exchange import dense_bytes, sparse_bytes, table_bytes

    rng = np.random.default_rng(0)
    worlds = [8, 16, 32, 64, 128, 256, 512]
    series = {v: [] for v in VARIANTS}
    for n in worlds:
        ids = zipf_ids(rng, (n, 512 * IDS_PER_EXAMPLE))
        unique = sum(len(np.unique(row)) for row in ids)  # each rank's unique rows, summed
        gather_all = sparse_bytes(n, n * 512 * IDS_PER_EXAMPLE, TABLE_DIM, 4, 4)
        dense = dense_bytes(n, TABLE_ROWS, TABLE_DIM, 4)
        ours = min(sparse_bytes(n, unique, TABLE_DIM, 4, 8), table_bytes(n, TABLE_ROWS, TABLE_DIM, 4))
        for v, b in zip(VARIANTS, (gather_all, dense, ours)):
            series[v].append(2 * b / 2 ** 20)
    common.print_table(["np", *VARIANTS], [[n, *(f"{series[v][i]:,.0f}" for v in VARIANTS)]
                                           for i, n in enumerate(worlds)],
                       title="recommender, two 1,000,000 x 64 float32 tables, 26 Zipf(1.1) ids per example each, "
                             "local batch 512: MiB each rank sends per step (ring formulas)")
    plt = common.matplotlib_pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for v in VARIANTS:
        ax.plot(worlds, series[v], marker="o", label=v)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("world size (ranks)")
    ax.set_ylabel("MiB sent per rank per step")
    ax.set_title("recommender tables: bytes per step")
    ax.legend()
    common.save_plot(fig, path)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launch", type=common.positive_int, default=None, metavar="NP", help="start NP ranks (Gloo)")
    p.add_argument("--models", nargs="+", default=["recommender", "text", "cnn"], choices=["recommender", "text", "cnn"])
    p.add_argument("--batch-size", type=common.positive_int, default=512, help="the recommender's local batch")
    p.add_argument("--table-rows", type=common.positive_int, default=TABLE_ROWS, help="rows of each recommender table")
    p.add_argument("--rounds", type=common.positive_int, default=5)
    p.add_argument("--steps", type=common.positive_int, default=5, help="steps per variant per round")
    p.add_argument("--warmup", type=common.positive_int, default=3)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads per rank (0: one per core of its share)")
    p.add_argument("--memory", action="store_true", help="each variant in its own job: its peak RSS")
    p.add_argument("--bytes-model", action="store_true", help="bytes on paper for np = 8 to 512, and a plot")
    p.add_argument("--plot", default=str(common.REPO / "benchmarks" / "figures" / "exchange_bytes.png"))
    p.add_argument("--only", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.bytes_model:
        return bytes_model(a.plot)
    if not a.launch:
        return worker(a)
    args = [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
            if k in ("batch_size", "table_rows", "rounds", "steps", "warmup", "threads")]
    for only in (VARIANTS if a.memory else (None,)):
        common.run_job(a.launch, __file__, args + ["--models", *a.models] + ([f"--only={only}"] if only else []),
                       stream=True)


if __name__ == "__main__":
    sys.exit(main())
