"""The training recipe, start to end, in Horovod's order: :func:`run`, the one path every training job takes.

Each step is one function of :mod:`hvdtrain.recipe_steps`, numbered as in the README's "What it
does"; how a run ends (errors, Ctrl-C, SIGTERM, lost ranks) is :mod:`hvdtrain.ending`'s.
"""
from __future__ import annotations

from typing import NamedTuple

from hvdtrain import keras_recipe as own
from hvdtrain import recipe_steps as steps
from hvdtrain.command_line_model import command_line_parts
from hvdtrain.config import Config
from hvdtrain.elastic import ElasticJob
from hvdtrain.ending import end_job_on_lost_peer, run_scope
from hvdtrain.keras_step import separate_random_streams
from hvdtrain.recipe_steps import Parts
from hvdtrain.rundir import default_run_dir
from hvdtrain.runtime.dist import current_rank
from hvdtrain.runtime.watchdog import Watchdog


class Outcome(NamedTuple):
    """A finished run: final metrics (the last epoch's, or the test set's), trained model, this rank."""

    metrics: dict
    model: object  # the trained Keras model (Keras 2 or 3)
    rank: int = 0


def run(config: Config, parts: Parts = Parts(), keep_horovod: bool = False) -> Outcome:
    """Train as configured on this rank; every rank of the job calls it.

    Args:
        config: the run's settings.
        parts: the caller's own model, data, loss, metrics, callbacks and optimizer, where given.
        keep_horovod: leave Horovod running after a run that ends well (:func:`hvdtrain.fit`).

    Raises:
        RunEnded: when the run fails or is stopped, on every rank, saying how this rank leaves
            (what it prints, its exit status; :func:`hvdtrain.ending.leave` acts on it).
    """
    watchdog = Watchdog(current_rank, config.runtime.stall_timeout)
    with run_scope(config, watchdog, keep_horovod) as scope:
        # 1. Init and pin: Horovod up, this process on its own GPU or CPU cores; a stalled peer aborts the job.
        ctx = scope.ctx = steps.init_and_pin(config, watchdog)
        if not config.elastic.enabled:  # heartbeats name a rank that stalls or is lost (elastic: Horovod's driver)
            watchdog.connect(ctx)
            end_job_on_lost_peer(config, ctx, watchdog, scope)
        own_step = None
        parts = command_line_parts(ctx, config, parts) or parts  # --model naming a Keras model object
        if parts.examples is None:
            # 2. Shard: the same data on every rank, a disjoint shard of each global batch, equal steps.
            data = steps.open_data(ctx, config, parts, watchdog)
            # 3. Model: on this rank's device, in the configured precision, with synchronized BatchNorm.
            watchdog.beat("building the model")
            model, keras = steps.build_rank_model(ctx, config, parts, data)
            # 4. Optimizer: learning rate x world size after warmup; hvd.DistributedOptimizer averages gradients.
            optimizer, schedule, loss_scale = steps.build_rank_optimizer(ctx, config, parts, model, keras, data.plan)
        else:  # 2-4 for a Keras model object, trained by its own step (hvdtrain.keras_recipe)
            data = own.open_examples(ctx, config, parts, watchdog)
            watchdog.beat("building the model")
            model, keras, schedule = ctx.guarded("compiling the model", lambda: own.build_model(ctx, config, parts, data))
            scope.own_step = own_step = own.build_step(ctx, parts, model, data, schedule)
            data = data._replace(objective=own_step.objective)
            optimizer, loss_scale = own_step.optimizers[0], None
        if config.elastic.enabled:  # steps 5-9, again whenever workers leave or join
            scope.elastic_job = ElasticJob(config, ctx, parts, data, model, optimizer, watchdog, loss_scale)
            return Outcome(scope.elastic_job.run(), model, current_rank())

        # 5. Restore: rank 0 opens the run directory, and the latest checkpoint on --resume.
        watchdog.beat("opening the run directory")
        run_dir = scope.run_dir = ctx.broadcast_object(config.log.dir or default_run_dir(), name="hvdtrain.run_dir")
        files = steps.restore(ctx, config, run_dir, model, optimizer, data)
        # 6. Broadcast: every rank starts from rank 0's weights and optimizer state (fresh or restored).
        watchdog.beat("broadcasting the initial state")
        steps.broadcast_state(ctx, model, own_step.optimizers if own_step else optimizer)
        if own_step is not None:  # rank 0's random state was broadcast too: each rank draws its own masks, noise
            separate_random_streams(model, config.seed, ctx.rank)
        # 7. Rank 0 only: banner, progress, logs, checkpoints; then the caller's callbacks.
        scope.callbacks = steps.rank_callbacks(ctx, config, parts, data, model, optimizer, schedule, files, own_step)
        # 8. Train: the same steps on every rank, each on its own shard.
        trainer = steps.make_trainer(ctx, config, data, model, optimizer, loss_scale, scope.callbacks, watchdog,
                                     own_step=own_step)
        metrics = trainer.fit(files.start, config.epochs, save_every=(config.checkpoint.every_steps,))
        # 9. Save: rank 0 writes the trained model (or prints an evaluation-only run's test metrics).
        steps.save_result(ctx, config, trainer, metrics, model, run_dir, watchdog)
        return Outcome(metrics, model, ctx.rank)
