"""A Keras model object's own step against hvdtrain's image step, on the same model in the same ranks.

    .venv/bin/python benchmarks/own_step.py [--rounds 3]

One np=2 job (``horovodrun --gloo``, one core per rank) builds the Keras 3 seed CNN (synchronized
BatchNorm, no dropout, SGD with momentum) three times from one seed and times, in alternating
rounds on the same Fashion-MNIST batches (float32 in memory, local batch 128):

* *hvdtrain's step*: the build-function path (``hvdtrain.step``, Horovod's ``DistributedOptimizer``);
* *Keras' default step*: the same model compiled, trained by Keras' ``train_step`` through
  :mod:`hvdtrain.keras_step` (the gradient exchange, the metrics as allreduced sums);
* *the model's own step*: a subclass whose ``train_step`` is Keras' default written out (tape,
  compiled loss, ``apply_gradients``, metrics).

Prints the median ms per step and the ratios to hvdtrain's step (medians of per-round ratios).
"""
import argparse
import os
import statistics

import common


def worker(a) -> None:
    from hvdtrain.runtime.dist import init_distributed

    ctx = init_distributed(threads=1)
    import numpy as np
    import tensorflow as tf

    from hvdtrain import broadcast_state, kerases
    from hvdtrain.config import OptimConfig
    from hvdtrain.data.examples import Examples
    from hvdtrain.data.in_memory import validate
    from hvdtrain.data.sharding import ShardPlan
    from hvdtrain.keras_recipe import OwnStep, first_batch
    from hvdtrain.keras_step import GradientExchange, MetricSums, probe
    from hvdtrain.model.zoo import norm_factory, seed_cnn
    from hvdtrain.optim import configured_optimizer
    from hvdtrain.recipe_steps import RankData
    from hvdtrain.trainer import Trainer

    keras = kerases.keras3()
    fashion = common.bench_dataset("cnn", a.batch_size, ctx.size)
    x = fashion.x_train.astype(np.float32) / 255.0
    data = validate(x, fashion.y_train, x[:10], fashion.y_test[:10], name="fashion float32")
    plan = ShardPlan(len(x), a.batch_size, ctx.size, ctx.rank)

    class OwnTrainStep(keras.Model):
        """Keras' default train_step, written out as a user's own."""

        def train_step(self, batch):
            images, labels = batch
            with tf.GradientTape() as tape:
                predictions = self(images, training=True)
                loss = self.compute_loss(x=images, y=labels, y_pred=predictions)
            self.compute_metrics(images, labels, predictions)  # Keras' metrics and loss tracker, as its default step
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            return {m.name: m.result() for m in self.metrics}

    def seeded():
        kerases.set_random_seed(0)
        return seed_cnn(data.input_shape, data.num_classes, norm=norm_factory(True, keras), dropout=0.0, keras=keras)

    runs = {"hvdtrain's step": common.hvdtrain_stepper(ctx, seeded(), data, a.batch_size)[1]}
    examples = Examples((x, data.y_train), None, name="fashion float32")
    for name, wrap in (("Keras' default step", None), ("the model's own step", OwnTrainStep)):
        model = seeded()
        if wrap is not None:
            model = wrap(model.inputs, model.outputs)
        optimizer, _ = configured_optimizer(OptimConfig(warmup_epochs=0), ctx.size, plan.steps_per_epoch, 100, keras)
        model.compile(optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        exchange = GradientExchange(ctx.size)
        exchange.wrap(optimizer)
        probe(model, exchange, first_batch(RankData(examples, None, {}, plan)))
        own = OwnStep(exchange, exchange.used(), MetricSums(model, ctx.size), None, name)
        broadcast_state(ctx, model, optimizer)
        trainer = Trainer(ctx, model, optimizer, examples, plan, own_step=own)
        runs[name] = stepper(trainer, plan, a.batch_size)
    times = common.alternating_step_times(ctx, runs, a.warmup, a.rounds, a.steps)
    if ctx.is_chief:
        first = "hvdtrain's step"
        common.write_result(a.result, {"samples": times.samples,
                                       "ratios": {name: times.ratio(name, first) for name in runs if name != first}})


def stepper(trainer, plan, batch_size: int):
    """``run(n)``: ``n`` of the trainer's steps on full local batches, then a wait (as ``hvdtrain_stepper``)."""
    import numpy as np

    def batches():
        epoch = 0
        while True:
            for _, indices, count in plan.epoch(epoch):
                if len(indices) == batch_size:
                    yield indices, np.float32(count)
            epoch += 1

    stream = batches()

    def run(n: int) -> None:
        for _ in range(n):
            trainer.train_step(*next(stream))
        trainer.wait()

    return run


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=common.positive_int, default=3, help="alternating rounds (medians over them)")
    p.add_argument("--steps", type=common.positive_int, default=20, help="timed steps per variant per round")
    p.add_argument("--warmup", type=common.positive_int, default=5, help="untimed steps first (tracing)")
    p.add_argument("--batch-size", type=common.positive_int, default=128, help="local batch per rank")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("benchmarks/own_step.py needs 2 cores (one per rank)")
    args = ["--rounds", str(a.rounds), "--steps", str(a.steps), "--warmup", str(a.warmup), "--batch-size",
            str(a.batch_size)]
    result = common.run_job(2, os.path.abspath(__file__), args, "gloo", cores=common.cores_for(2))
    first = "hvdtrain's step"
    rows = [[name, f"{statistics.median(samples) * 1e3:.2f}",
             "1" if name == first else f"{result['ratios'][name]:.3f}"] for name, samples in result["samples"].items()]
    common.print_table(["Keras 3 seed CNN, sync BN, np=2", "ms/step", f"/ {first}"], rows,
                       f"the same model three ways, {a.rounds} alternating round(s) of {a.steps} steps")


if __name__ == "__main__":
    main()
