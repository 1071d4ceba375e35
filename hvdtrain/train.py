"""The training recipe, start to end: init, pin, shard, scale LR, wrap optimizer, broadcast, train.

:func:`run` is the one path a training job takes; :class:`Trainer` holds the compiled steps.
"""
from __future__ import annotations

import os
import sys
import time
from typing import List, Optional

import numpy as np
import tensorflow as tf

from hvdtrain import callbacks as cbs
from hvdtrain.checkpoint import CheckpointManager, check_resumable, require_checkpoint_dir
from hvdtrain.config import Config
from hvdtrain.data import Dataset, data_mismatch, load_dataset
from hvdtrain.dist import (DistContext, PeerFailure, PeerLost, current_rank, init_distributed, is_peer_loss,
                           launcher_rank)
from hvdtrain.elastic import train_elastic
from hvdtrain.errors import HvdtrainError, describe_differences, say
from hvdtrain.files import refuse_a_file_in_the_way
from hvdtrain.models import build_model
from hvdtrain.optim import build_optimizer
from hvdtrain.sharding import ShardPlan, eval_shard
from hvdtrain.stop import Terminated, defer_stop_signals, stop_exception, stop_requested
from hvdtrain.sync_bn import SyncBatchNormalization
from hvdtrain.watchdog import Watchdog, in_collective


def _loss_and_sums(logits: tf.Tensor, labels: tf.Tensor):
    """Per-example cross-entropy ``(b,)`` and this batch's float64 ``[loss sum, correct, count]``.

    Logits of any float dtype (bfloat16/float16 under a mixed-precision policy) are taken to float32.
    """
    logits = tf.cast(logits, tf.float32)
    per_example = tf.keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
    correct = tf.equal(tf.argmax(logits, 1, output_type=tf.int32), labels)
    sums = tf.stack([tf.reduce_sum(tf.cast(per_example, tf.float64)), tf.reduce_sum(tf.cast(correct, tf.float64)),
                     tf.cast(tf.size(labels), tf.float64)])
    return per_example, sums


# Keras' batch norm layers. Under Horovod (no tf.distribute strategy) each one, Keras' own
# synchronized variants included, updates its moving statistics from its own rank's batches.
_KERAS_BATCH_NORMS = (tf.keras.layers.BatchNormalization, tf.keras.layers.experimental.SyncBatchNormalization)


def _per_rank(layer: tf.Module) -> bool:
    """Whether ``layer`` is a batch norm layer that updates its moving statistics per rank."""
    return (isinstance(layer, _KERAS_BATCH_NORMS)
            or isinstance(layer, SyncBatchNormalization) and not layer.synchronized)


def per_rank_moving_statistics(model: tf.keras.Model) -> List[tf.Variable]:
    """The moving statistics of the built per-rank batch norm layers in ``model``, nested ones
    included: their floating-point non-trainable variables (moving mean and variance, and with
    Keras' ``renorm=True`` its moving standard deviation and renormalization statistics).

    Such a layer (Keras' own, in a user's model, or :class:`hvdtrain.SyncBatchNormalization` with
    ``synchronized=False``, as ``--no-sync-bn`` builds) updates them from its own rank's batches,
    so they drift apart across ranks; a synchronized one keeps them identical. A layer that was
    never called has none yet.
    """
    return [v for layer in model.submodules if _per_rank(layer) and layer.built
            for v in layer.non_trainable_weights if v.dtype.is_floating]


def _to_model_input(images: tf.Tensor) -> tf.Tensor:
    """uint8 pixels -> float32 in [0, 1]; float data passes through as float32."""
    if images.dtype == tf.uint8:
        return tf.cast(images, tf.float32) * (1.0 / 255.0)
    return tf.cast(images, tf.float32)


class Trainer:
    """Runs epochs of data-parallel training on one rank.

    The training set lives on this rank's device once; each step sends only the int32 indices of
    the local batch (from the :class:`ShardPlan`), and the compiled step gathers the examples.

    Args:
        ctx: this process's distributed context.
        model: the Keras model (variables already broadcast from rank 0).
        optimizer: ``hvd.DistributedOptimizer``-wrapped optimizer, variables built and broadcast.
        dataset: the whole dataset (every rank holds it; each reads only its shard per step).
        plan: this rank's shard plan.
        log_every: steps between global running metrics.
        eval_batch_size: evaluation batch per rank.
        callbacks: side effects; chief-only ones only on the chief.
        watchdog: told of every finished step; aborts the rank if progress stops.
        agree_on_side_effects: every rank agrees on the outcome of rank 0's checkpoint and log
            writes before the other callbacks run (elastic jobs; see :meth:`_checkpoint_hook`).
        backward_passes_per_step: the optimizer's gradient accumulation K (steps per update); the
            plan's steps per epoch must be a multiple of it.

    Raises:
        ValueError: if a chief-only callback is given to another rank.
    """

    def __init__(self, ctx: DistContext, model: tf.keras.Model, optimizer, dataset: Dataset, plan: ShardPlan,
                 log_every: int = 50, eval_batch_size: int = 1000, callbacks: Optional[List[cbs.Callback]] = None,
                 watchdog: Optional[Watchdog] = None, agree_on_side_effects: bool = False,
                 backward_passes_per_step: int = 1):
        self.ctx, self.model, self.optimizer, self.plan = ctx, model, optimizer, plan
        self.backward_passes_per_step = backward_passes_per_step
        self.agree_on_side_effects = agree_on_side_effects
        self.watchdog = watchdog or Watchdog(ctx.rank, timeout_s=0)
        self.log_every, self.eval_batch_size = log_every, eval_batch_size
        self.callbacks = list(callbacks or [])
        if not ctx.is_chief and any(cb.chief_only for cb in self.callbacks):
            raise ValueError("chief-only callbacks given to a non-chief rank")
        test = eval_shard(len(dataset.y_test), ctx.size, ctx.rank)
        with tf.device(ctx.device):
            self.x_train = tf.constant(dataset.x_train)
            self.y_train = tf.constant(dataset.y_train)
            self.x_test = tf.constant(dataset.x_test[test])
            self.y_test = tf.constant(dataset.y_test[test])
            # Local sums since the epoch began: [loss, correct predictions, examples], float64 so
            # that sums over an epoch stay exact.
            self._sums = tf.Variable(tf.zeros(3, tf.float64), trainable=False, name="epoch_sums")
        self.train_step = self._make_train_step()
        self.eval_step = self._make_eval_step()
        self.count_non_finite = self._make_count_non_finite()
        self._moving_statistics = per_rank_moving_statistics(model)
        # Non-finite values the model starts with (a -inf mask, say) are its own, not a divergence.
        self._non_finite_at_start = int(self.count_non_finite())

    # ---- compiled steps --------------------------------------------------------------------------
    def _make_train_step(self):
        model, optimizer, world_size = self.model, self.optimizer, float(self.ctx.size)

        @tf.function(input_signature=[tf.TensorSpec([None], tf.int32), tf.TensorSpec([], tf.float32)])
        def train_step(indices, global_count):
            images = _to_model_input(tf.gather(self.x_train, indices))
            labels = tf.gather(self.y_train, indices)
            with tf.GradientTape() as tape:
                logits = model(images, training=True)
                per_example, sums = _loss_and_sums(logits, labels)
                # Sum over the local batch scaled by world_size / global_count: Horovod averages the
                # ranks' gradients, so the result is the gradient of the mean loss over the global
                # batch, exact even when local batches differ in size (the last step of an epoch).
                loss = tf.reduce_sum(per_example) * (world_size / global_count)
                if model.losses:
                    loss += tf.add_n(model.losses)
            # Allreduce (average) of the gradients happens in the wrapped compute_gradients.
            optimizer.apply_gradients(optimizer.compute_gradients(loss, model.trainable_variables, tape=tape))
            self._sums.assign_add(sums)

        return train_step

    def _make_eval_step(self):
        model = self.model

        @tf.function(input_signature=[tf.TensorSpec([], tf.int32), tf.TensorSpec([], tf.int32)])
        def eval_step(start, end):
            images = _to_model_input(self.x_test[start:end])
            labels = self.y_test[start:end]
            return _loss_and_sums(model(images, training=False), labels)[1]

        return eval_step

    def _make_count_non_finite(self):
        """A compiled function: the number (int64 scalar) of NaN and infinite values in the model's
        floating-point variables (weights and moving statistics)."""
        variables = [v for v in self.model.variables if v.dtype.is_floating]

        @tf.function(input_signature=[])
        def count_non_finite():
            counts = [tf.reduce_sum(tf.cast(tf.logical_not(tf.math.is_finite(v)), tf.int64)) for v in variables]
            return tf.add_n(counts) if counts else tf.constant(0, tf.int64)

        return count_non_finite

    def _update_mean_count(self, step: int) -> float:
        """With gradient accumulation: the mean global batch over the passes of ``step``'s update.

        Horovod applies the average of K passes' gradients, each a mean over its own global batch,
        which would weight a short last batch like a full one. Scaling every pass's loss by this
        mean count instead makes the update the mean over all the update's examples, as one step
        on their union would be. (The epoch's steps are a multiple of K: see :func:`run`.)
        """
        k = self.backward_passes_per_step
        first = step - step % k
        return sum(self.plan.global_batch_size(s) for s in range(first, first + k)) / k

    # ---- exact global metrics ---------------------------------------------------------------------
    def _global_mean(self, local_sums, name: str) -> dict:
        """Allreduce ``[loss_sum, correct, count]`` and divide: exact over all ranks' examples."""
        return self._mean(self.ctx.allreduce_sum(np.asarray(local_sums), name=name))

    @staticmethod
    def _mean(sums) -> dict:
        """Loss and accuracy from global ``[loss_sum, correct, count]`` sums."""
        loss_sum, correct, count = sums
        return {"loss": loss_sum / max(count, 1.0), "accuracy": correct / max(count, 1.0), "count": int(count)}

    @staticmethod
    def _diverged(what: str) -> HvdtrainError:
        """The error that stops every rank at the same point, where ``what`` was found NaN or
        infinite (from allreduced values, so every rank finds it alike).

        Returns:
            The :class:`HvdtrainError` to raise, marked ``on_every_rank``.
        """
        error = HvdtrainError(
            f"training diverged: {what}; every rank stopped there. No diverged state was checkpointed: --resume "
            f"from the last checkpoint with a smaller --lr or longer --warmup-epochs")
        error.on_every_rank = True  # found from allreduced values: every rank raises at the same point
        return error

    def _checked(self, metrics: dict, epoch: int, step: int) -> dict:
        """Stop every rank at the same step when the global training loss is NaN or infinite.

        The metrics are allreduced, so every rank sees the same value at the same step and raises
        together. Each step's loss is computed before its update: :meth:`_check_saveable` checks the
        update before a save.

        Returns:
            ``metrics``, when its loss is finite.

        Raises:
            HvdtrainError: on every rank alike, when it is not.
        """
        if not np.isfinite(metrics["loss"]):
            raise self._diverged(f"the global training loss is {metrics['loss']} at epoch {epoch + 1}, step {step + 1}")
        return metrics

    def _sums_and_state(self, name: str):
        """Before a checkpoint, an elastic commit or an evaluation: one allreduce of the epoch's
        ``[loss, correct, count]`` sums so far, of each rank's count of NaN and infinite values in
        the model's floating-point variables beyond those it started with, and of per-rank
        BatchNorm's moving statistics, which every rank then replaces by their mean over the ranks.

        The loss checks cannot see the last update before a save (its loss was computed before
        it), so the variables are counted too, on every rank (they may differ between ranks), and
        the counts are summed, so that every rank finds a NaN alike. Averaging the per-rank
        statistics (:func:`per_rank_moving_statistics`, as timm's ``distribute_bn`` does) makes the
        model every rank evaluates the one rank 0 saves, and a resumed run the same as one never
        stopped. The moving variances are averaged, not pooled with the spread of the ranks'
        moving means: each rank's estimates the variance within a local batch, which is what
        training normalized with, and with globally shuffled data the means differ by sampling
        noise only.

        Returns:
            ``(sums, non_finite)``: the global sums (float64 array of 3) and the global count (int).
        """
        new = max(0, int(self.count_non_finite()) - self._non_finite_at_start)
        statistics = [v.numpy().ravel() for v in self._moving_statistics]
        total = self.ctx.allreduce_sum(np.concatenate([self._sums.numpy(), [float(new)], *statistics]), name=name)
        offset = 4
        for variable, local in zip(self._moving_statistics, statistics):
            mean = total[offset:offset + local.size] / self.ctx.size
            variable.assign(mean.reshape(variable.shape).astype(variable.dtype.as_numpy_dtype))
            offset += local.size
        return total[:3], int(total[3])

    def _check_saveable(self, sums, non_finite: int, epoch: int, step: int) -> dict:
        """Stop every rank alike, before a save after ``step`` (0-based) of ``epoch``, if the global
        training loss in ``sums`` or any variable (``non_finite``, from :meth:`_sums_and_state`)
        is NaN or infinite.

        Returns:
            The training metrics of ``sums`` (:meth:`_mean`), when both are finite.

        Raises:
            HvdtrainError: on every rank alike.
        """
        metrics = self._checked(self._mean(sums), epoch, step)
        if non_finite:
            raise self._diverged(f"{non_finite:,} value(s) of the model's variables are NaN or infinite at the "
                                 f"check after epoch {epoch + 1}, step {step + 1}")
        return metrics

    def evaluate(self) -> dict:
        """Loss and accuracy over the whole test set, each example counted once (a collective)."""
        sums = np.zeros(3)
        n = int(self.y_test.shape[0])
        for start in range(0, n, self.eval_batch_size):
            sums += self.eval_step(start, min(start + self.eval_batch_size, n)).numpy()
            self.watchdog.beat(f"evaluation batch at example {start}")
        return self._global_mean(sums, "hvdtrain.eval")

    def _checkpoint_hook(self, hook: str, *args) -> None:
        """Call ``hook`` (``on_train_begin``, ``on_mid_epoch_checkpoint``, ``on_epoch_end`` or
        ``on_evaluation_only``: the hooks where rank 0 writes files) on every callback.

        With ``agree_on_side_effects`` (elastic jobs): rank 0's callbacks and the others' local
        halves (the commit's save) first, then every rank agrees on the outcome of rank 0's
        writes (one small allreduce), then :meth:`ElasticCommit.after_agreement`. An error in
        rank 0's writes (a full disk, say) then stops every rank together, instead of each new
        rank 0 meeting it in turn after a reset.
        """
        if not self.agree_on_side_effects:
            for cb in self.callbacks:
                getattr(cb, hook)(*args)
            return
        error = None
        try:
            for cb in self.callbacks:
                if cb.chief_only:
                    getattr(cb, hook)(*args)
        except Exception as e:  # noqa: BLE001 -- re-raised by agree() on this rank
            error = e
        others = [cb for cb in self.callbacks if not cb.chief_only]
        if error is None:
            for cb in others:
                getattr(cb, hook)(*args)
        self.ctx.agree(error, "writing logs and checkpoints")
        for cb in others:
            cb.after_agreement()

    # ---- the loop -------------------------------------------------------------------------------
    def fit(self, start_epoch: int, epochs: int, start_step: int = 0, start_sums=None,
            checkpoint_every: int = 0, start_example: int = 0, commit_every: int = 0) -> dict:
        """Train from step ``start_step`` of epoch ``start_epoch`` to the end of epoch ``epochs - 1``.

        Every rank runs the same steps and collectives in the same order.

        Args:
            start_epoch, start_step: where to begin (a resumed run continues mid-epoch).
            start_sums: global ``[loss, correct, count]`` sums of the epoch's steps before
                ``start_step`` (from the checkpoint), so that the epoch's metrics stay exact.
            checkpoint_every: also checkpoint every this many steps within an epoch (0: only at the
                end of epochs); each costs one small allreduce on every rank (the metric sums, the
                count of non-finite variables and per-rank BatchNorm's moving statistics: 2·C
                numbers per layer) and a pass over the variables.
            start_example: or begin at this position of the epoch's permutation (an elastic job
                continuing at another world size; see :meth:`ShardPlan.epoch`).
            commit_every: elastic jobs: commit the state every this many steps (0: never).

        Returns:
            The last epoch's metrics (or, with nothing left to train, the test metrics).

        Raises:
            ValueError: with epochs to train, if the steps per epoch are not a multiple of
                ``backward_passes_per_step`` (:func:`run` checks it first, with a clear message).
        """
        metrics, steps = {}, self.plan.steps_per_epoch
        if start_epoch < epochs and steps % self.backward_passes_per_step:
            raise ValueError(f"{steps} steps per epoch are not a multiple of backward_passes_per_step "
                             f"{self.backward_passes_per_step}")
        self._checkpoint_hook("on_train_begin", start_epoch, epochs)  # rank 0 may rewrite metrics.jsonl
        for epoch in range(start_epoch, epochs):
            first, first_example = (start_step, start_example) if epoch == start_epoch else (0, 0)
            first = self.plan.start_step(first, first_example)
            for cb in self.callbacks:
                cb.on_epoch_begin(epoch, steps, first)
            # The sums of the steps before `first` are global: they enter once, on rank 0.
            resumed = (first or first_example) and start_sums is not None
            carried = np.asarray(start_sums if resumed else np.zeros(3), np.float64)
            self._sums.assign(carried if self.ctx.is_chief else np.zeros(3))
            start = time.perf_counter()
            for step, indices, global_count in self.plan.epoch(epoch, first, first_example):
                if self.backward_passes_per_step > 1:
                    global_count = self._update_mean_count(step)
                with in_collective(f"the allreduces of epoch {epoch + 1}, step {step + 1}"):
                    self.train_step(indices, np.float32(global_count))
                self.watchdog.beat(f"epoch {epoch + 1}, step {step + 1}")
                running = None
                if (step + 1) % self.log_every == 0:
                    running = self._checked(self._global_mean(self._sums.numpy(), "hvdtrain.running"), epoch, step)
                if any(every and (step + 1) % every == 0 for every in (checkpoint_every, commit_every)) \
                        and step + 1 < steps:
                    sums, non_finite = self._sums_and_state("hvdtrain.checkpoint_sums")
                    self._check_saveable(sums, non_finite, epoch, step)  # never save a diverged state
                    self._checkpoint_hook("on_mid_epoch_checkpoint", epoch, step + 1, sums)
                for cb in self.callbacks:
                    cb.on_step_end(epoch, step, running)
            sums, non_finite = self._sums_and_state("hvdtrain.train")
            elapsed = time.perf_counter() - start  # up to the epoch's last update and its metrics' allreduce
            # Checked before the evaluation, which NaN weights would spoil.
            train = self._check_saveable(sums, non_finite, epoch, steps - 1)
            test = self.evaluate()
            if not np.isfinite(test["loss"]):  # finite variables, but outputs that overflow
                raise self._diverged(f"the global test loss is {test['loss']} after epoch {epoch + 1}")
            metrics = {
                "train_loss": train["loss"], "train_accuracy": train["accuracy"],
                "test_loss": test["loss"], "test_accuracy": test["accuracy"],
                "train_examples": train["count"],
                "images_per_sec": (train["count"] - carried[2]) / elapsed,
                "epoch_time_s": elapsed,
                "lr": float(self.optimizer.learning_rate(self.optimizer.iterations))
                if callable(self.optimizer.learning_rate) else float(self.optimizer.learning_rate),
                "world_size": self.ctx.size,
            }
            self._checkpoint_hook("on_epoch_end", epoch, metrics)
            self.watchdog.beat(f"the end of epoch {epoch + 1}")
        if not metrics:  # nothing left to train (epochs reached): report the test metrics
            test = self.evaluate()
            metrics = {"test_loss": test["loss"], "test_accuracy": test["accuracy"], "world_size": self.ctx.size}
            position = {"epoch": start_epoch, "step_in_epoch": start_step, "example_in_epoch": start_example}
            self._checkpoint_hook("on_evaluation_only", position, metrics)
        return metrics


def open_run_dir(config: Config, run_dir: str, ckpt_dir: str, model, optimizer, fresh: bool,
                 must_exist: bool = False) -> CheckpointManager:
    """Rank 0: create the run directory and the checkpoint manager.

    Args:
        fresh: the run starts here (no ``--resume``): refuse a log directory that already holds
            another run's ``metrics.jsonl``, which this run would overwrite, and a checkpoint
            directory that already holds checkpoints, which this run would mix with its own.
        must_exist: the checkpoint directory must exist already (a ``--resume`` start), so that
            nothing is created for a mistyped path.

    Raises:
        HvdtrainError: if a directory is not writable, if ``fresh`` and metrics or checkpoints
            exist, or if ``must_exist`` and the checkpoint directory does not.
    """
    if must_exist:
        require_checkpoint_dir(ckpt_dir)
    metrics_file = os.path.join(run_dir, "metrics.jsonl")
    if fresh and os.path.isfile(metrics_file) and os.path.getsize(metrics_file):
        raise HvdtrainError(f"log directory {run_dir} already holds the metrics of another run (metrics.jsonl); "
                            f"pass --resume to continue that run, or choose another --log-dir")
    refuse_a_file_in_the_way(run_dir, "log directory", "--log-dir")
    try:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, ".write-test"), "w"):
            pass
        os.remove(os.path.join(run_dir, ".write-test"))
    except OSError as e:
        raise HvdtrainError(f"log directory {run_dir} is not writable: {e.strerror or e}") from None
    manager = CheckpointManager(ckpt_dir, model, optimizer, keep=config.checkpoint.keep)
    latest = manager.latest()
    if fresh and latest:
        raise HvdtrainError(f"checkpoint directory {ckpt_dir} already holds {os.path.basename(latest)}; "
                            f"pass --resume to continue that run, or choose another --log-dir/--checkpoint-dir")
    return manager


def agree_on_data(ctx: DistContext, fingerprint: dict) -> None:
    """Check that every rank loaded the same data as rank 0 (a collective).

    Args:
        ctx: this process's context.
        fingerprint: this rank's :meth:`hvdtrain.data.Dataset.fingerprint`.

    Raises:
        HvdtrainError: on the lowest rank whose data differ from rank 0's, naming what differs
            (the other ranks raise :class:`PeerFailure`).
    """
    chief = ctx.broadcast_object(fingerprint, name="hvdtrain.data_fingerprint")
    ctx.agree(data_mismatch(ctx.rank, fingerprint, chief) if fingerprint != chief else None, "checking the data")


def _check_accumulation_fits_epochs(plan: ShardPlan, passes: int) -> None:
    """Refuse ``--backward-passes-per-step`` K unless the steps per epoch are a multiple of K.

    Horovod applies an update every K passes and keeps the passes since the last one in memory:
    an update spanning two epochs would cross the epoch's checkpoint and lose them.

    Raises:
        HvdtrainError: on every rank alike, suggesting the nearest local batch sizes that fit.
    """
    if plan.steps_per_epoch % passes == 0:
        return
    n, batch = plan.num_examples, plan.local_batch
    fitting = [b for b in range(1, 2 * batch)
               if ShardPlan(n, b, plan.world_size, plan.rank).steps_per_epoch % passes == 0]
    nearest = sorted(sorted(fitting, key=lambda b: abs(b - batch))[:2])
    hint = f"; --batch-size {' or '.join(map(str, nearest))} would do" if nearest else ""
    error = HvdtrainError(f"--backward-passes-per-step {passes} needs the steps per epoch to be a multiple of "
                          f"{passes} so that no update spans two epochs; here they are {plan.steps_per_epoch} "
                          f"({n} examples / global batch {plan.global_batch}){hint}")
    error.on_every_rank = True  # every rank has the same plan
    raise error


def _open_checkpoints(config: Config, run_dir: str, ckpt_dir: str, model, optimizer, layout: dict):
    """Rank 0: the checkpoint manager and where to start, ``(manager, (epoch, step, sums))``,
    restoring the latest checkpoint if ``--resume`` (from the beginning if the checkpoint directory
    exists but holds none yet).

    ``layout`` (world size, local batch, steps per epoch, seed, the data's fingerprint) must match
    the checkpoint's: a resumed run continues the same sequence of global batches, so these
    cannot change.
    """
    resume = config.checkpoint.resume
    manager = open_run_dir(config, run_dir, ckpt_dir, model, optimizer, fresh=not resume, must_exist=resume)
    if not resume:
        return manager, (0, 0, None)
    if manager.latest() is None:
        start_without_checkpoint(ckpt_dir, run_dir)
        return manager, (0, 0, None)
    latest, meta = manager.restore_latest()
    if meta.get("elastic"):
        raise HvdtrainError(f"--resume: {latest} was written by an elastic job, whose steps mix world sizes; "
                            f"resume it with --elastic")
    check_resumable(latest, meta, layout)
    changed = _changed_settings(config, meta.get("config"))
    if config.epochs <= int(meta["epoch"]):  # evaluation only: fewer epochs asked for is no change to report
        changed = [c for c in changed if not c.startswith("epochs:")]
    if changed:  # allowed (a longer run, a lower rate), but the run is no longer the one checkpointed
        say(f"--resume: settings changed since {os.path.basename(latest)}: {'; '.join(changed)}")
    return manager, (int(meta["epoch"]), int(meta.get("step_in_epoch", 0)), meta.get("epoch_sums"))


def start_without_checkpoint(ckpt_dir: str, run_dir: Optional[str]) -> None:
    """Rank 0, ``--resume`` with a checkpoint directory that holds no checkpoint: the run stopped
    before its first save (what a requeued job meets), so it starts from the beginning -- unless
    its ``metrics.jsonl`` records more than one finished epoch: then its checkpoints were removed,
    and starting over would overwrite its metrics. (One epoch may be logged without its checkpoint,
    by a stop between the two.)

    Raises:
        HvdtrainError: if ``run_dir``'s metrics record an epoch after the first.
    """
    metrics_file = os.path.join(run_dir, "metrics.jsonl") if run_dir else ""
    logged = cbs.logged_epochs(metrics_file) if os.path.isfile(metrics_file) else []
    epochs = max((epoch for epoch, _ in logged), default=0)
    if epochs > 1:
        raise HvdtrainError(f"--resume: no checkpoint in {ckpt_dir}, but {metrics_file} records {epochs} epochs: "
                            f"that run's checkpoints were removed; choose another --log-dir to start over")
    say(f"--resume: no checkpoint in {ckpt_dir} yet (the run stopped before its first save); "
        f"starting from the beginning")


def _changed_settings(config: Config, saved: Optional[dict]) -> List[str]:
    """The settings of ``config`` that differ from the checkpointed run's ``saved`` config, as
    ``"key: <now> here, <then> there"``, leaving out what does not change the training: where
    files are (directories; other data is refused by :func:`check_resumable`), how the run is shown
    or placed (progress, threads, stall timeout) and the evaluation batch."""
    if not saved:
        return []
    ignored = {"checkpoint": ("dir", "resume"), "log": ("dir", "progress", "log_every"), "runtime": None,
               "data": ("data_dir", "eval_batch_size")}
    ours, theirs = config.to_dict(), dict(saved)
    for section, keys in ignored.items():
        for side in (ours, theirs):
            if keys is None:
                side.pop(section, None)
            elif isinstance(side.get(section), dict):
                side[section] = {k: v for k, v in side[section].items() if k not in keys}
    return describe_differences(ours, theirs, "there")


def chief_callbacks(config: Config, run_dir: str, manager: CheckpointManager, plan: ShardPlan, optimizer,
                    meta: dict) -> List[cbs.Callback]:
    """Rank 0's side effects: progress bar, epoch lines, metrics.jsonl, TensorBoard, checkpoints."""
    return ([cbs.ProgressBar()] if config.log.progress else []) + [
        cbs.EpochLine(config.epochs),
        cbs.JsonlMetrics(run_dir),
        cbs.TensorBoard(run_dir, plan.steps_per_epoch, restart_markers=not config.elastic.enabled),
        cbs.Checkpointer(manager, meta, plan, optimizer.iterations, every_steps=config.checkpoint.every_steps),
    ]


def banner(ctx: DistContext, config: Config, dataset: Dataset, plan: ShardPlan, schedule, model,
            run_dir: str, ckpt_dir: str, start_epoch: int, start_step: int) -> str:
    """Rank 0's start-up lines: world size and pinning, data, batch arithmetic, learning rate,
    model, run directory and where training starts (0-based ``start_epoch``/``start_step``)."""
    last = plan.global_batch_size(plan.steps_per_epoch - 1)
    leftover = last - plan.global_batch
    passes = config.optim.backward_passes_per_step
    epochs = (f"epochs {start_epoch + 1}..{config.epochs}" if start_epoch < config.epochs
              else f"no epoch left to train of {config.epochs} (evaluation only)")
    return "\n".join([
        f"hvdtrain: world size {ctx.size} ({ctx.local_size} local rank(s) x {ctx.cross_size} host(s)), "
        f"device {ctx.device}, {ctx.intra_op_threads} thread(s) per rank",
        f"data:  {dataset.name}: {len(dataset.y_train):,} train / {len(dataset.y_test):,} test, "
        f"{'x'.join(map(str, dataset.input_shape))}, {dataset.num_classes} classes",
        f"batch: local {plan.local_batch} x {ctx.size} rank(s) = global {plan.global_batch}; "
        f"{plan.steps_per_epoch} steps per epoch (last global batch {last}"
        + (f": the {leftover} example(s) left over, fewer than the ranks, join it" if leftover > 0 else "") + ")"
        + (f"; {passes} passes per update: {plan.global_batch * passes} examples per update, "
           f"{plan.steps_per_epoch // passes} updates per epoch" if passes > 1 else ""),
        f"lr:    base {schedule.base_lr:g} x {ctx.size} = peak {schedule.peak_lr:g}, linear warmup "
        f"{config.optim.warmup_epochs:g} epoch(s) ({schedule.warmup_steps} steps), then {config.optim.lr_schedule}",
        f"model: {config.model.name} "
        f"({'user model' if ':' in config.model.name else ('synchronized' if config.model.sync_bn else 'per-rank') + ' BatchNorm'}), "
        f"{model.count_params():,} parameters",
        f"run:   {run_dir} (checkpoints {ckpt_dir}), {epochs}"
        + (f", resuming at step {start_step + 1} of epoch {start_epoch + 1}" if start_step else ""),
    ])


def broadcast_state(ctx: DistContext, model: tf.keras.Model, optimizer) -> None:
    """Overwrite every rank's model and optimizer variables with rank 0's (a collective).

    Needed once the variables exist -- random initialisation differs per rank -- and after rank 0
    restores a checkpoint. The optimizer's slots must already be built (``optimizer.build``).
    """
    if ctx.size > 1:
        import horovod.tensorflow as hvd

        hvd.broadcast_variables(model.variables + list(optimizer.variables), root_rank=0)


def _peer_lost(ctx: DistContext, watchdog: Watchdog) -> BaseException:
    """The error for a collective that failed because a peer went away, naming it when known:
    :class:`PeerLost`, or :class:`Terminated` if the peer was stopped on purpose (a launcher
    passing Ctrl-C on, a scheduler's SIGTERM: this rank's own comes next)."""
    failed, lost, stopped = watchdog.lost_peers()
    if failed:  # that rank printed its own error
        return PeerLost(f"rank(s) {sorted(failed)} failed: {'; '.join(failed.values())}", report=False)
    if stopped and not lost:
        return Terminated()
    who = f"rank {', '.join(map(str, lost))} was lost" if lost else "another rank failed or was lost"
    report = ctx.is_chief or (0 in lost and ctx.rank == 1)
    return PeerLost(f"{who} mid-training (its process ended or became unreachable), so Horovod shut down on "
                    f"every rank. Resume from the last checkpoint with --resume.", report=report)


def _stopped(ctx: DistContext, watchdog: Watchdog, interrupt: KeyboardInterrupt) -> BaseException:
    """Ctrl-C or SIGTERM on this rank: the peers learn that it stops on purpose.

    A launcher also sends SIGTERM to the other ranks when one rank dies or fails, so that rank is
    named (:func:`_peer_lost`) instead of the stop: at once when it failed with its own error or
    its process on this host has ended, after :meth:`Watchdog.lost_peers`' wait of heartbeat
    silence for another host.

    Returns:
        What to raise: ``interrupt``, or the :class:`PeerLost` naming the failed or lost rank.
    """
    if ctx.size == 1:
        return interrupt
    watchdog.report_stopped()
    failed, lost, _ = watchdog.lost_peers()
    return _peer_lost(ctx, watchdog) if failed or lost else interrupt


def run(config: Config) -> dict:
    """Train as configured on this rank; every rank of the job calls it. Returns the final metrics.

    Raises:
        HvdtrainError: on every rank (printed once) for bad data, model, directories or checkpoints.
        PeerLost: when another rank failed or was lost mid-training (naming it where known).
        KeyboardInterrupt: on Ctrl-C; :class:`hvdtrain.stop.Terminated` on SIGTERM, once
            :func:`hvdtrain.stop.install_stop_handlers` was called. Either carries ``run_dir``,
            the run directory to resume from, or None if no checkpoint directory exists yet.
    """
    # 1. Init and pin: Horovod up, this process on its own GPU or its own CPU cores. From the
    #    moment every rank is up (hvd.init), a rank left waiting for a stalled or unreachable
    #    peer -- in a start-up collective or in training -- aborts after --stall-timeout instead
    #    of hanging (the watchdog, armed by init_distributed).
    watchdog = Watchdog(launcher_rank(), config.runtime.stall_timeout)
    try:
        ctx = init_distributed(threads=config.runtime.threads, use_gpu=not config.runtime.cpu,
                               stall_timeout=config.runtime.stall_timeout, elastic=config.elastic.enabled,
                               watchdog=watchdog)
    except BaseException:
        watchdog.close()
        raise
    callbacks: List[cbs.Callback] = []
    run_dir = ckpt_dir = None
    try:
        watchdog.arm("start-up")
        # Heartbeats to and from rank 0, so that a stall names the rank that stalled. (Not in an
        # elastic job: its ranks change, and Horovod's driver reports the workers it loses.)
        if not config.elastic.enabled:
            watchdog.connect(ctx)
        watchdog.beat("loading data")
        # Same seed everywhere; initial weights are broadcast from rank 0 anyway (step 6).
        tf.keras.utils.set_random_seed(config.seed)

        # 2. Data: every rank loads the (small, in-memory) dataset; the plan gives each rank a
        #    disjoint shard per epoch and the same number of steps.
        dataset = ctx.guarded("loading data", lambda: load_dataset(config.data.dataset, config.data.data_dir, config.seed))
        # The shard plan assumes every rank holds the same examples (same steps per rank,
        # disjoint shards): a host with another copy of the data would hang or overlap.
        fingerprint = dataset.fingerprint()
        if not config.elastic.enabled:  # an elastic job checks after each state sync instead
            agree_on_data(ctx, fingerprint)
        plan = ShardPlan(len(dataset.y_train), config.batch_size, ctx.size, ctx.rank, seed=config.seed)
        passes = config.optim.backward_passes_per_step
        if config.epochs > 0:
            _check_accumulation_fits_epochs(plan, passes)
        if len(dataset.y_train) < plan.global_batch:
            error = HvdtrainError(f"{dataset.name}: {len(dataset.y_train)} training examples are fewer than one global "
                                  f"batch ({ctx.size} ranks x --batch-size {config.batch_size}); use a smaller --batch-size")
            error.on_every_rank = True  # every rank loaded the same data and checks the same numbers
            raise error

        # 3. Model, on this rank's device.
        watchdog.beat("building the model")
        with tf.device(ctx.device):
            model = ctx.guarded("building the model", lambda: build_model(
                config.model.name, dataset.input_shape, dataset.num_classes, sync_bn=config.model.sync_bn,
                seed=config.seed, rank=ctx.rank))

            # 4. Optimizer: learning rate scaled by world size with warmup; Horovod's wrapper
            #    averages gradients by allreduce. Its slots are built now so they can be broadcast.
            optimizer, schedule = build_optimizer(config.optim, ctx.size, plan.steps_per_epoch, config.epochs)
            optimizer.build(model.trainable_variables)

        if config.elastic.enabled:
            # Steps 5-8, re-run whenever workers leave or join (hvdtrain.elastic), which names the
            # run directory (rank 0's at the first sync) and hands it out on the error it raises.
            return train_elastic(config, ctx, dataset, fingerprint, model, optimizer, watchdog)

        # 5. Run directory and checkpoints (rank 0 only writes), restored state on resume.
        run_dir = ctx.broadcast_object(config.log.dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S")),
                                       name="hvdtrain.run_dir")
        ckpt_dir = config.checkpoint.dir or os.path.join(run_dir, "checkpoints")
        layout = {"world_size": ctx.size, "batch_size": config.batch_size, "steps_per_epoch": plan.steps_per_epoch,
                  "seed": config.seed, "data": fingerprint}
        watchdog.beat("opening the run directory")
        manager, start = ctx.guarded(
            "opening the run directory",
            lambda: _open_checkpoints(config, run_dir, ckpt_dir, model, optimizer, layout) if ctx.is_chief
            else (None, None))
        start_epoch, start_step, start_sums = ctx.broadcast_object(start, name="hvdtrain.start")
        if start_step % passes:
            # Horovod's count of accumulated passes starts at 0 in this process: the resumed step
            # must begin an update (a checkpoint of a run with another --backward-passes-per-step).
            error = HvdtrainError(f"--resume: the checkpoint is at step {start_step} of epoch {start_epoch + 1}, inside "
                                  f"an update of --backward-passes-per-step {passes}; resume with the "
                                  f"--backward-passes-per-step of the run that wrote it")
            error.on_every_rank = True
            raise error

        # 6. Broadcast: every rank starts from rank 0's weights and optimizer state (fresh or restored).
        watchdog.beat("broadcasting the initial state")
        with in_collective("the broadcast of the initial state"):
            broadcast_state(ctx, model, optimizer)

        # 7. Rank-0 side effects: banner, progress, logs, checkpoints -- the one chief-only block.
        if ctx.is_chief:
            say(banner(ctx, config, dataset, plan, schedule, model, run_dir, ckpt_dir, start_epoch, start_step))
            meta = {"model": config.model.name, **layout, "config": config.to_dict()}
            callbacks = chief_callbacks(config, run_dir, manager, plan, optimizer, meta)

        # 8. Train: the same steps on every rank.
        watchdog.beat("the first training step")
        trainer = Trainer(ctx, model, optimizer, dataset, plan, log_every=config.log.log_every,
                          eval_batch_size=config.data.eval_batch_size, callbacks=callbacks, watchdog=watchdog,
                          backward_passes_per_step=passes)
        metrics = trainer.fit(start_epoch, config.epochs, start_step=start_step, start_sums=start_sums,
                              checkpoint_every=config.checkpoint.every_steps)
        if ctx.is_chief and "train_loss" not in metrics:
            say(f"test loss {metrics['test_loss']:.4f} acc {metrics['test_accuracy']:.4f}")
        return metrics
    except PeerFailure:
        defer_stop_signals()  # from here on, while this rank reports how it ends, SIGTERM is only recorded
        raise
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (hvdtrain.stop)
        defer_stop_signals()
        raise _stopped(ctx, watchdog, e)
    except Exception as e:  # noqa: BLE001
        defer_stop_signals()
        if stop_requested():  # the interrupt may have cut into TensorFlow and come out as another error
            raise _stopped(ctx, watchdog, stop_exception()) from e
        if getattr(e, "on_every_rank", False):
            # Raised alike on every rank: the rank 0 of now prints it (an elastic job's rank 0
            # may be another process than the one the launcher started as rank 0).
            e.report = current_rank() == 0
        if is_peer_loss(e) and not getattr(e, "rank_found", False):
            raise _peer_lost(ctx, watchdog) from e
        if not getattr(e, "rank_found", False) and not getattr(e, "on_every_rank", False):
            # An error of this rank alone: it prints it, and the peers learn from its heartbeat not
            # to. It must not wait for Horovod's shutdown, which needs every rank while the others
            # are mid-collective: it exits at once (hvdtrain.cli), which ends their collectives.
            watchdog.report_failure(f"{type(e).__name__}: {e}")
            e.skip_horovod_shutdown = True
        raise
    finally:
        # The run has ended, either way: while it closes its logs, SIGTERM is only recorded (a
        # scheduler's SIGTERM after the last checkpoint must not turn a finished run into a stopped one).
        defer_stop_signals()
        error = sys.exc_info()[1]
        if error is not None:  # after Ctrl-C or SIGTERM, hvdtrain.cli says where the run can be resumed from
            # An elastic run's directory is named in hvdtrain.elastic, which puts it on its error.
            if run_dir is None:
                run_dir = getattr(error, "run_dir", None) or getattr(error.__cause__, "run_dir", None)
                if run_dir:
                    ckpt_dir = config.checkpoint.dir or os.path.join(run_dir, "checkpoints")
            error.run_dir = run_dir if ckpt_dir and os.path.isdir(ckpt_dir) else None
        watchdog.close()
        cbs.close_all(callbacks)
        # Not after Ctrl-C either: Horovod's shutdown would wait for peers that may still be running.
        if not isinstance(error, KeyboardInterrupt) and not getattr(error, "skip_horovod_shutdown", False):
            ctx.close()
