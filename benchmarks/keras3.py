"""Keras 3 through hvdtrain: its step time against the same model in Keras 2, and its img/s against
``tf.distribute.MirroredStrategy``, the one multi-device path Keras 3 has on TensorFlow.

    .venv/bin/python benchmarks/keras3.py [--rounds 3]

1. *Keras 3 / Keras 2*: one np=2 job (``horovodrun --gloo``, one core per rank) builds the seed
   CNN (synchronized BatchNorm, no dropout) twice, with Keras 2 and with Keras 3, and times
   hvdtrain's compiled training step of each in alternating rounds (the same processes, data and
   batches): median step time and the ratio Keras 3 / Keras 2 (median of the rounds' ratios).
2. *hvdtrain / MirroredStrategy*: the Keras 3 seed CNN on 2 cores, alternating whole jobs per
   round: hvdtrain at np=2 (one core and one intra-op thread per rank), against one process on the
   same 2 cores with two logical CPU devices under ``MirroredStrategy`` and Keras 3's
   ``model.fit`` (its BatchNormalization ``synchronized=True``, the same global batch); each timed
   over the same number of steps after a warm-up, img/s of the global batch. Synchronized batch
   norm both ways: hvdtrain's allreduce-based layer against Keras' ``tf.distribute`` one.

Fashion-MNIST (in memory), local batch 128. Prints tables only.
"""
import argparse
import os
import statistics
import sys
import time

import common


def step_worker(a) -> None:
    """np=2: Keras 2 and Keras 3 seed CNNs side by side in the same ranks (part 1)."""
    from hvdtrain.runtime.dist import init_distributed

    ctx = init_distributed(threads=1)
    from hvdtrain import kerases
    from hvdtrain.model.zoo import norm_factory, seed_cnn

    data = common.bench_dataset("cnn", a.batch_size, ctx.size)
    runs = {}
    for version in (2, 3):
        keras = kerases.module(version)
        kerases.set_random_seed(0)
        model = seed_cnn(data.input_shape, data.num_classes, norm=norm_factory(True, keras), dropout=0.0, keras=keras)
        runs[f"keras{version}"] = common.hvdtrain_stepper(ctx, model, data, a.batch_size)[1]
    times = common.alternating_step_times(ctx, runs, a.warmup, a.rounds, a.steps)
    if ctx.is_chief:
        common.write_result(a.result, {"keras2": times.samples["keras2"], "keras3": times.samples["keras3"],
                                       "ratio": times.ratio("keras3", "keras2")})


def hvdtrain_worker(a) -> None:
    """np=2: the Keras 3 seed CNN's img/s through hvdtrain (part 2)."""
    from hvdtrain.runtime.dist import init_distributed

    ctx = init_distributed(threads=1)
    from hvdtrain import kerases
    from hvdtrain.model.zoo import norm_factory, seed_cnn

    data = common.bench_dataset("cnn", a.batch_size, ctx.size)
    keras = kerases.keras3()
    kerases.set_random_seed(0)
    model = seed_cnn(data.input_shape, data.num_classes, norm=norm_factory(True, keras), dropout=0.0, keras=keras)
    run = common.hvdtrain_stepper(ctx, model, data, a.batch_size)[1]
    run(a.warmup)
    start = time.perf_counter()
    run(a.steps)
    rate = a.batch_size * ctx.size * a.steps / (time.perf_counter() - start)
    if ctx.is_chief:
        common.write_result(a.result, {"images_per_sec": rate})


def mirrored_worker(a) -> None:
    """One process, two logical CPU devices, MirroredStrategy and Keras 3's fit (part 2)."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    tf.config.threading.set_intra_op_parallelism_threads(2)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    import keras

    from hvdtrain.model.zoo import seed_cnn, unfused_norm

    data = common.bench_dataset("cnn", a.batch_size, 2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    global_batch = a.batch_size * strategy.num_replicas_in_sync
    with strategy.scope():
        keras.utils.set_random_seed(0)
        norm = unfused_norm(lambda: keras.layers.BatchNormalization(momentum=0.9, synchronized=True))
        model = seed_cnn(data.input_shape, data.num_classes, norm=norm, dropout=0.0, keras=keras)
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = data.x_train[:global_batch * (a.warmup + a.steps)].astype("float32") / 255.0
    y = data.y_train[:global_batch * (a.warmup + a.steps)]

    class Timer(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == a.warmup - 1:
                self.start = time.perf_counter()

        def on_train_end(self, logs=None):
            self.seconds = time.perf_counter() - self.start

    timer = Timer()
    model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
    common.write_result(a.result, {"images_per_sec": global_batch * a.steps / timer.seconds,
                                   "replicas": strategy.num_replicas_in_sync})


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=common.positive_int, default=3, help="alternating rounds (medians over them)")
    p.add_argument("--steps", type=common.positive_int, default=20, help="timed steps per variant per round")
    p.add_argument("--warmup", type=common.positive_int, default=5, help="untimed steps first (tracing)")
    p.add_argument("--batch-size", type=common.positive_int, default=128, help="local batch per rank (replica)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--part", choices=("step", "hvdtrain", "mirrored"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return {"step": step_worker, "hvdtrain": hvdtrain_worker, "mirrored": mirrored_worker}[a.part](a)
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("benchmarks/keras3.py needs 2 cores (one per rank)")
    args = ["--rounds", str(a.rounds), "--steps", str(a.steps), "--warmup", str(a.warmup), "--batch-size",
            str(a.batch_size)]
    script = os.path.abspath(__file__)
    step = common.run_job(2, script, [*args, "--part", "step"], "gloo", cores=common.cores_for(2))
    keras2, keras3 = (statistics.median(step[k]) for k in ("keras2", "keras3"))
    common.print_table(["seed CNN, sync BN, np=2", "Keras 2 ms/step", "Keras 3 ms/step", "Keras 3 / Keras 2"],
                       [["hvdtrain's step", f"{keras2 * 1e3:.2f}", f"{keras3 * 1e3:.2f}", f"{step['ratio']:.3f}"]],
                       f"1. the same model in Keras 2 and Keras 3, {a.rounds} alternating round(s) of {a.steps} steps")
    rates = {"hvdtrain": [], "mirrored": []}
    for r in range(a.rounds):
        for part in (["hvdtrain", "mirrored"] if r % 2 == 0 else ["mirrored", "hvdtrain"]):
            np_, transport = (2, "gloo") if part == "hvdtrain" else (1, "single")
            result = common.run_job(np_, script, [*args, "--part", part], transport, cores=common.cores_for(2))
            rates[part].append(result["images_per_sec"])
    ratio = common.median_ratio(rates["hvdtrain"], rates["mirrored"])
    common.print_table(
        ["Keras 3 seed CNN, sync BN, 2 cores", *[f"round {r + 1} img/s" for r in range(a.rounds)], "median img/s"],
        [["hvdtrain, np=2", *[f"{v:,.0f}" for v in rates["hvdtrain"]], f"{statistics.median(rates['hvdtrain']):,.0f}"],
         ["MirroredStrategy, 2 logical CPUs", *[f"{v:,.0f}" for v in rates["mirrored"]],
          f"{statistics.median(rates['mirrored']):,.0f}"]],
        f"2. hvdtrain / MirroredStrategy = {ratio:.3f} (median of the rounds' ratios)")


if __name__ == "__main__":
    sys.exit(main())
