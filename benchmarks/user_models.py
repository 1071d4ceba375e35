"""A user's own Keras model through hvdtrain, in Keras 2 and in Keras 3, against plain Horovod + Keras 2 ``fit``.

    .venv/bin/python benchmarks/user_models.py                    # np=2 over Gloo, 3 rounds
    .venv/bin/python benchmarks/user_models.py --rounds 5 --train-examples 60000

The model is a user's, as Keras' examples write one: ``Conv2D`` 32 and 64 (5x5), each with Keras'
``BatchNormalization`` (per rank: not converted), a dense 128 with BatchNormalization,
``Dropout(0.25)``, Adam (1e-3), local batch 128, Fashion-MNIST in memory, 2 epochs. Each round runs
three whole np=2 jobs in turn (``horovodrun --gloo``), so machine noise hits each alike:

* ``horovod + keras 2 fit``: Horovod's Keras recipe (``hvd.keras.DistributedOptimizer``,
  ``BroadcastGlobalVariablesCallback``, each rank its ``rank::size`` shard, one intra-op thread
  per rank, Horovod's own ``HOROVOD_DISABLE_GROUP_FUSION=0``);
* ``hvdtrain, keras 2``: the model written with ``tf.keras`` (Keras 2 once hvdtrain is imported),
  ``hvdtrain.fit(build, ...)`` with the user's optimizer;
* ``hvdtrain, keras 3``: the same model written with ``import keras``.

The figure is the last epoch's training img/s (its images over its wall time; hvdtrain's own
``images_per_sec``), and each job's ratio to the Horovod job of its round (medians over rounds).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import common

VARIANTS = ("horovod + keras 2 fit", "hvdtrain, keras 2", "hvdtrain, keras 3")
EPOCHS, BATCH = 2, 128


def build(keras, input_shape=(28, 28, 1), num_classes=10):
    """The user's model: ``(batch, 28, 28, 1)`` float32 images -> ``(batch, 10)`` logits."""
    layers = keras.layers
    return keras.Sequential([
        keras.Input(input_shape),
        layers.Conv2D(32, 5, padding="same", use_bias=False), layers.BatchNormalization(), layers.ReLU(),
        layers.MaxPooling2D(),
        layers.Conv2D(64, 5, padding="same", use_bias=False), layers.BatchNormalization(), layers.ReLU(),
        layers.MaxPooling2D(),
        layers.Flatten(), layers.Dense(128, use_bias=False), layers.BatchNormalization(), layers.ReLU(),
        layers.Dropout(0.25), layers.Dense(num_classes)])


def fashion(train_examples: int):
    from hvdtrain.config import DEFAULT_DATA_DIR
    from hvdtrain.data.in_memory import load_idx_dir

    d = load_idx_dir(DEFAULT_DATA_DIR)
    return d.x_train[:train_examples], d.y_train[:train_examples], d.x_test[:2000], d.y_test[:2000]


def horovod_worker(a) -> float:
    """Horovod's Keras recipe, Keras 2: the last epoch's img/s."""
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import horovod.tensorflow.keras as hvd
    import tensorflow as tf

    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)  # one core per rank, as hvdtrain pins
    keras = tf.keras
    x_train, y_train, _, _ = fashion(a.train_examples)
    x = (x_train.reshape(-1, 28, 28, 1) / 255.0).astype("float32")
    x, y = x[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]
    model = build(keras)
    model.compile(hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3)),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    rates = []

    class EpochRate(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            rates.append(len(x) * hvd.size() / (time.perf_counter() - self.start))

    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), EpochRate()])
    return rates[-1]


def hvdtrain_worker(a, version: int, log_dir: str) -> float:
    """``hvdtrain.fit`` of the model in Keras ``version``: the last epoch's img/s."""
    import tensorflow as tf

    import hvdtrain

    if version == 3:
        import keras
    else:
        keras = tf.keras
    result = hvdtrain.fit(lambda input_shape, num_classes: build(keras, input_shape, num_classes),
                          fashion(a.train_examples), optimizer=keras.optimizers.Adam(1e-3), epochs=EPOCHS,
                          batch_size=BATCH, log={"dir": log_dir})
    return result.history[-1]["images_per_sec"]


def job(variant: str, a, tmp: str, index: int) -> float:
    out = os.path.join(tmp, f"result{index}.json")
    args = [__file__, "--worker", variant, "--result", out, "--train-examples", str(a.train_examples),
            "--log-dir", os.path.join(tmp, f"run{index}")]
    extra = {"HOROVOD_DISABLE_GROUP_FUSION": "0"} if variant.startswith("horovod") else None
    done = subprocess.run(common.launch_command(2, args), env=common.env_for_ranks(extra), capture_output=True,
                          text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{variant}: exit {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)["images_per_sec"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=common.at_least(1), default=3)
    p.add_argument("--train-examples", type=common.at_least(600), default=24000)
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--log-dir", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        rate = (horovod_worker(a) if a.worker.startswith("horovod")
                else hvdtrain_worker(a, 3 if a.worker.endswith("3") else 2, a.log_dir))
        if int(os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))) == 0:
            common.write_result(a.result, {"images_per_sec": rate})
        return
    rates = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for i, variant in enumerate(VARIANTS):
                rates[variant].append(job(variant, a, tmp, r * len(VARIANTS) + i))
            print(f"round {r + 1}: " + ", ".join(f"{v} {rates[v][-1]:,.0f} img/s" for v in VARIANTS), flush=True)
    base = rates[VARIANTS[0]]
    rows = [[v, f"{statistics.median(rates[v]):,.0f}",
             f"{statistics.median([x / b for x, b in zip(rates[v], base)]):.3f}",
             f"{statistics.median([x / k2 for x, k2 in zip(rates[v], rates[VARIANTS[1]])]):.3f}"] for v in VARIANTS]
    common.print_table(["job", "img/s (median)", "/ horovod + keras 2 fit", "/ hvdtrain, keras 2"], rows,
                       title=f"np=2 over Gloo, {a.train_examples:,} images, last of {EPOCHS} epochs, {a.rounds} "
                             f"round(s); ratios are medians of the rounds' own")


if __name__ == "__main__":
    main()
