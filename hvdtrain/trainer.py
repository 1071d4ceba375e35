"""The training loop of one rank: epochs of compiled steps (:mod:`hvdtrain.step`), exact global
metrics, and hooks for saving.

:class:`Trainer` knows nothing of run directories or elastic jobs: what happens at a save point
(a checkpoint, an elastic commit) is a callback's (:mod:`hvdtrain.callbacks`).
"""
from __future__ import annotations

import time
from typing import List, Optional, Sequence, Union

import numpy as np
import tensorflow as tf

from hvdtrain import callbacks as cbs
from hvdtrain import kerases
from hvdtrain.data.in_memory import Dataset
from hvdtrain.data.sharding import ShardPlan, eval_shard
from hvdtrain.data.stream import PIPELINE_NICE, StreamingDataset, behind_the_step
from hvdtrain.errors import HvdtrainError
from hvdtrain.losses import sparse_categorical_crossentropy
from hvdtrain.metrics import Accuracy
from hvdtrain.task import Objective, prefixed
from hvdtrain.optim import last_learning_rate
from hvdtrain.model.moving_statistics import per_rank_moving_statistics
from hvdtrain.precision import DynamicLossScale
from hvdtrain.runtime.dist import DistContext, in_collective
from hvdtrain.runtime.watchdog import Watchdog
from hvdtrain.position import TrainPosition
from hvdtrain.step import gathered, make_train_step, streamed, to_model_input
from hvdtrain.data.examples import StreamedExamples
from hvdtrain.divergence import checked, diverged, non_finite_counter, saveable
from hvdtrain.runtime.signals import stop_signal, stops_at_a_step
from hvdtrain.runtime.stops import StopCheck, Stopped
from hvdtrain.keras_step import evaluate_locally, own_step_functions, test_rows


FIRST_BATCH_MAX_S = 3600.0  # how long the stall check waits for a stream's first batch of an epoch


class Trainer:
    """Runs epochs of data-parallel training on one rank.

    An in-memory training set lives on this rank's device once; each step sends only the int32
    indices of the local batch (from the :class:`ShardPlan`), and the compiled step gathers the
    examples. A :class:`StreamingDataset` is read by tf.data instead, one local batch of the
    plan's size per step.

    Args:
        ctx: this process's distributed context.
        model: the Keras model, Keras 2 or 3 (variables already broadcast from rank 0).
        optimizer: ``hvd.DistributedOptimizer``-wrapped optimizer, variables built and broadcast.
        dataset: the whole in-memory dataset (every rank holds it; each reads only its shard per
            step), or a streaming one (each rank reads only its shard).
        plan: this rank's shard plan.
        log_every: steps between global running metrics.
        eval_batch_size: evaluation batch per rank.
        callbacks: side effects; chief-only ones only on the chief.
        watchdog: told of every finished step; aborts the rank if progress stops.
        agree_on_writes: every rank agrees on the outcome of rank 0's checkpoint and log writes
            before the other callbacks finish (elastic jobs; see :meth:`_write_hook`).
        stop_on_signal: SIGTERM and SIGUSR1 stop every rank after the same step, checkpointed
            (:meth:`fit`); False for elastic jobs, whose driver ends a worker with SIGTERM to reset
            the others: there the signal ends the rank at once, as without hvdtrain.
        backward_passes_per_step: the optimizer's gradient accumulation K (steps per update); the
            plan's steps per epoch must be a multiple of it.
        loss_scale: for ``--precision fp16``, the :class:`~hvdtrain.precision.DynamicLossScale`
            (its variables among the optimizer's): a step whose allreduced gradients are not
            finite is skipped on every rank, its examples left out of the metrics.
        xla: compile the forward and backward pass with XLA (``jit_compile``); the model must
            hold no collective op (synchronized BatchNorm at world size > 1).
        objective: the loss and the metrics (default: sparse categorical cross-entropy and
            accuracy); :meth:`fit` reports ``train_<name>`` and ``test_<name>`` of each.
        pipeline_nice: the nice level of a streamed dataset's pipeline threads
            (:func:`~hvdtrain.data.stream.behind_the_step`).
        own_step: a Keras model object's :class:`~hvdtrain.keras_recipe.OwnStep`: its own
            ``train_step`` and ``test_step`` run on :mod:`hvdtrain.data.examples`, its metrics the objective.

    Raises:
        HvdtrainError: for a model and optimizer of different Kerases (:func:`hvdtrain.kerases.choose`).
        ValueError: if a chief-only callback is given to another rank.
    """

    def __init__(self, ctx: DistContext, model, optimizer, dataset: Union[Dataset, StreamingDataset],
                 plan: ShardPlan, log_every: int = 50, eval_batch_size: int = 1000,
                 callbacks: Optional[List[cbs.Callback]] = None,
                 watchdog: Optional[Watchdog] = None, agree_on_writes: bool = False,
                 backward_passes_per_step: int = 1, loss_scale: Optional[DynamicLossScale] = None,
                 xla: bool = False, objective: Optional[Objective] = None, pipeline_nice: int = PIPELINE_NICE,
                 own_step=None, stop_on_signal: bool = True):
        kerases.choose(0, model=model, optimizer=optimizer)  # one Keras: Horovod's wrapper matches the optimizer's
        self.ctx, self.model, self.optimizer, self.plan = ctx, model, optimizer, plan
        self.backward_passes_per_step = backward_passes_per_step
        self.loss_scale = loss_scale
        self.objective = objective or Objective(sparse_categorical_crossentropy(), [Accuracy()])
        self.agree_on_writes, self.stop_on_signal = agree_on_writes, stop_on_signal
        self.watchdog = watchdog or Watchdog(lambda: ctx.rank, timeout_s=0)
        self.log_every, self.eval_batch_size = log_every, eval_batch_size
        self.pipeline_nice = pipeline_nice
        self.callbacks = list(callbacks or [])
        if not ctx.is_chief and any(cb.chief_only for cb in self.callbacks):
            raise ValueError("chief-only callbacks given to a non-chief rank")
        self.own_step, self.dataset = own_step, dataset
        self.stream = dataset if isinstance(dataset, (StreamingDataset, StreamedExamples)) else None
        with tf.device(ctx.device):
            if own_step is not None:
                self.objective = own_step.objective
                self._sums, self.train_step, self.eval_step, self.test_tensors = own_step_functions(
                    model, own_step, dataset, ctx.size, ctx.rank, in_memory=self.stream is None)
                self.local_gradients = None
            elif self.stream is None:
                test = eval_shard(dataset.num_test, ctx.size, ctx.rank)
                self.x_train = tf.constant(dataset.x_train)
                self.y_train = tf.constant(dataset.y_train)
                self.x_test = tf.constant(dataset.x_test[test])
                self.y_test = tf.constant(dataset.y_test[test])
                inputs = gathered(self.x_train, self.y_train)
            else:
                inputs = streamed(dataset.input_shape, dataset.image_dtype, dataset.label_shape)
            # The objective's local sums since the epoch began (loss, examples, each metric's),
            # float64 so that sums over an epoch stay exact.
            if own_step is None:
                self._sums = tf.Variable(tf.zeros(self.objective.size, tf.float64), trainable=False, name="epoch_sums")
        if own_step is None:
            self.train_step, self.local_gradients = make_train_step(model, optimizer, ctx.size, inputs, self.objective,
                                                                    self._sums, loss_scale, xla)
            self.eval_step = self._make_eval_step()
        self.count_non_finite = non_finite_counter(model)
        self._moving_statistics = per_rank_moving_statistics(model)
        self.stopped_after: Optional[int] = None  # the (1-based) epoch a callback stopped training after
        # Non-finite values the model starts with (a -inf mask, say) are its own, not a divergence.
        self._non_finite_at_start = int(self.count_non_finite())

    # ---- compiled steps --------------------------------------------------------------------------
    def wait(self) -> None:
        """Block until every training step issued so far has finished (steps run asynchronously:
        this reads the epoch's sums, which the last step wrote)."""
        self._sums.numpy()

    def _make_eval_step(self):
        """A compiled function: the objective's sums of one evaluation batch, given as ``(start,
        end)`` of the test shard in memory, or ``(images, labels)`` streamed."""
        model, objective = self.model, self.objective
        if self.stream is None:
            signature = [tf.TensorSpec([], tf.int32), tf.TensorSpec([], tf.int32)]

            def batch(start, end):
                return to_model_input(self.x_test[start:end]), self.y_test[start:end]
        else:
            inputs = streamed(self.stream.input_shape, self.stream.image_dtype, self.stream.label_shape)
            signature, batch = inputs.signature, inputs.batch

        @tf.function(input_signature=signature)
        def eval_step(*args):
            images, labels = batch(*args)
            return objective(labels, model(images, training=False))[1]

        return eval_step

    def _epoch_inputs(self, epoch: int, first: int, first_example: int):
        """Yield ``(step, inputs, global_count)`` for the steps of ``epoch`` from ``first``: the
        train step's arguments (:mod:`hvdtrain.step`) and the examples in the global batch.

        Raises:
            HvdtrainError: for a stream that fails (naming the example: file, record) or gives
                fewer examples than counted, on this rank.
        """
        if self.stream is None:
            for step, indices, global_count in self.plan.epoch(epoch, first, first_example):
                yield step, (indices,), global_count
            return
        batches, sizes = self.stream.train_batches(self.plan, epoch, first, first_example,
                                                   threads=self.ctx.intra_op_threads)
        iterator = behind_the_step(batches, self.pipeline_nice)
        # Filling a shuffle buffer, or a resumed epoch reading up to where it stopped, is no stall.
        self.watchdog.pause(f"reading the first batch of epoch {epoch + 1}", FIRST_BATCH_MAX_S)
        for step, size in enumerate(sizes, start=first):
            try:
                batch = next(iterator)
            except StopIteration:
                batch = None
            except tf.errors.OpError as e:
                raise self.stream.failed_step(e, self.plan, epoch, step, first, first_example) from None
            got = 0 if batch is None else int(tf.nest.flatten(batch)[0].shape[0])
            if got != size:
                raise HvdtrainError(f"{self.stream.name}: rank {self.ctx.rank} got {got} example(s) at epoch {epoch + 1}, "
                                    f"step {step + 1}, where {size} were planned: the data gave fewer examples this "
                                    f"epoch than the {self.stream.num_train:,} counted at the start")
            # hvdtrain's step takes (images, labels); a model's own step its whole batch
            yield step, ((batch,) if self.own_step else batch), self.plan.global_batch_size(step, first_example)

    def _update_mean_count(self, step: int) -> float:
        """With gradient accumulation: the mean global batch over the passes of ``step``'s update.

        Horovod applies the average of K passes' gradients, each a mean over its own global batch,
        which would weight a short last batch like a full one. Scaling every pass's loss by this
        mean count instead makes the update the mean over all the update's examples, as one step
        on their union would be. (The epoch's steps are a multiple of K: see :meth:`fit`.)
        """
        k = self.backward_passes_per_step
        first = step - step % k
        return sum(self.plan.global_batch_size(s) for s in range(first, first + k)) / k

    # ---- exact global metrics and divergence checks --------------------------------------------------
    def _global_mean(self, local_sums, name: str) -> dict:
        """Allreduce the objective's sums and compute its metrics: exact over all ranks' examples."""
        return self.objective.results(self.ctx.allreduce_sum(np.asarray(local_sums), name=name))

    def _sums_and_state(self, name: str):
        """Before a save point or an evaluation: one allreduce of the epoch's objective sums so
        far, of each rank's count of NaN and infinite values in the model's
        floating-point variables beyond those it started with, and of per-rank BatchNorm's moving
        statistics, which every rank then replaces by their mean over the ranks.

        The loss checks cannot see the last update before a save, so the variables are counted
        too, and the counts summed, so that every rank finds a NaN alike. Averaging the per-rank
        statistics (:func:`per_rank_moving_statistics`, as timm's ``distribute_bn``) makes the model
        every rank evaluates the one rank 0 saves. The moving variances are averaged, not pooled
        with the spread of the ranks' means: each estimates the variance within a local batch,
        which is what training normalized with.

        Returns:
            ``(sums, non_finite)``: the global sums (float64 array) and the global count (int).
        """
        new = max(0, int(self.count_non_finite()) - self._non_finite_at_start)
        statistics = [v.numpy().ravel() for v in self._moving_statistics]
        total = self.ctx.allreduce_sum(np.concatenate([self._sums.numpy(), [float(new)], *statistics]), name=name)
        size = self.objective.size
        offset = size + 1
        for variable, local in zip(self._moving_statistics, statistics):
            mean = total[offset:offset + local.size] / self.ctx.size
            variable.assign(mean.reshape(variable.shape).astype(tf.as_dtype(variable.dtype).as_numpy_dtype))
            offset += local.size
        return total[:size], int(total[size])

    def evaluate(self) -> dict:
        """The loss and metrics over the whole test set, each example counted once (a collective)."""
        if self.own_step is not None:
            return self._evaluate_own()
        sums = np.zeros(self.objective.size)
        if self.stream is None:
            n = int(self.y_test.shape[0])
            for start in range(0, n, self.eval_batch_size):
                sums += self.eval_step(start, min(start + self.eval_batch_size, n)).numpy()
                self.watchdog.beat(f"evaluation batch at example {start}")
        else:
            try:
                batches = self.stream.test_batches(self.ctx.size, self.ctx.rank, self.eval_batch_size,
                                                   self.ctx.intra_op_threads)
                for images, labels in behind_the_step(batches, self.pipeline_nice):
                    sums += self.eval_step(images, labels).numpy()
                    self.watchdog.beat("an evaluation batch")
            except tf.errors.OpError as e:
                raise self.stream.failed_evaluation(e, self.ctx.size, self.ctx.rank) from None
        return self._global_mean(sums, "hvdtrain.eval")

    def _evaluate_own(self) -> dict:
        """:meth:`evaluate` with the model's own ``test_step``; ``{}`` where there is no test set."""
        if not self.dataset.num_test:
            return {}
        if self.stream is None:
            batches = test_rows(self.test_tensors, self.eval_batch_size)
        else:
            batches = behind_the_step(self.stream.test_batches(self.ctx.size, self.ctx.rank, self.eval_batch_size,
                                                               self.ctx.intra_op_threads), self.pipeline_nice)
        try:
            local = evaluate_locally(self.eval_step, self.objective, batches,
                                     lambda: self.watchdog.beat("an evaluation batch"))
        except tf.errors.OpError as e:
            if self.stream is None:  # the model's own test_step failed, not a pipeline
                raise
            raise self.stream.failed_evaluation(e, self.ctx.size, self.ctx.rank) from None
        results = self._global_mean(local, "hvdtrain.eval")
        return {k: v for k, v in results.items() if k not in self.objective.extras}  # the training step's

    def _write_hook(self, hook: str, *args) -> None:
        """Call ``hook`` (``on_train_begin``, ``on_save_point``, ``on_stop``, ``on_epoch_end`` or
        ``on_evaluation_only``: the hooks where rank 0 writes files) on every callback.

        With ``agree_on_writes`` (elastic jobs): rank 0's callbacks and the others' local halves
        (the commit's save) first, then every rank agrees on the outcome of rank 0's writes (one
        small allreduce), then :meth:`Callback.after_agreement`. An error in rank 0's writes (a
        full disk, say) then stops every rank together, instead of each new rank 0 meeting it in
        turn after a reset. The stop's checkpoint (``on_stop``) is always agreed on: the other
        ranks exit right after it, and a launcher then ends rank 0, which must have written it.
        """
        if not (self.agree_on_writes or hook == "on_stop"):
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

    def _stop_requested(self, epoch: int) -> bool:
        """Whether a callback on any rank set ``stop_training`` (one small allreduce: every rank stops alike).

        Raises:
            Stopped: where any rank received a stop signal (the epoch's checkpoint is written).
        """
        signalled = self.stop_on_signal and stop_signal() is not None
        local = [any(getattr(cb, "stop_training", False) for cb in self.callbacks), signalled]
        by_callback, by_signal = self.ctx.allreduce_sum(local, name=f"hvdtrain.stop_training.{epoch}") > 0
        if by_signal:
            raise Stopped(stop_signal(), f"epoch {epoch + 1}")
        return bool(by_callback)

    # ---- the loop -------------------------------------------------------------------------------
    def fit(self, start: TrainPosition, epochs: int, save_every: Sequence[int] = ()) -> dict:
        """Train from ``start`` to the end of epoch ``epochs - 1``.

        Every rank runs the same steps and collectives in the same order.

        Args:
            start: where to begin: its ``step`` of this plan or its ``example`` of the epoch's
                permutation, whichever is later (an elastic job continues at another world size;
                see :meth:`ShardPlan.start_step`), with the global sums of the epoch so far.
            epochs: the epoch to stop before (0-based; the run's total).
            save_every: within epochs, a save point every this many steps, for each number given
                (0s are ignored): checkpoints, elastic commits. Each costs one small allreduce on
                every rank (the metric sums, the count of non-finite variables and per-rank
                BatchNorm's moving statistics: 2·C numbers per layer) and a pass over the
                variables, then calls :meth:`Callback.on_save_point`.

        Returns:
            The last epoch's metrics (or, with nothing left to train, the test metrics).

        Raises:
            ValueError: with epochs to train, if the steps per epoch are not a multiple of
                ``backward_passes_per_step`` (:mod:`hvdtrain.recipe` checks it first, with a clear message).
            EveryRankError: if training diverges (on every rank at the same step).
            Stopped: with ``stop_on_signal``, on every rank after the same step, once a rank
                received SIGTERM or SIGUSR1 (:mod:`hvdtrain.runtime.stops`), with the checkpoint
                that resumes there written.
        """
        if not self.stop_on_signal:
            return self._fit(start, epochs, save_every, None)
        with stops_at_a_step():
            return self._fit(start, epochs, save_every, StopCheck(self.ctx))

    def _fit(self, start: TrainPosition, epochs: int, save_every: Sequence[int], stops: Optional[StopCheck]) -> dict:
        metrics, steps = {}, self.plan.steps_per_epoch
        if start.epoch < epochs and steps % self.backward_passes_per_step:
            raise ValueError(f"{steps} steps per epoch are not a multiple of backward_passes_per_step "
                             f"{self.backward_passes_per_step}")
        save_every = [every for every in save_every if every]
        self._write_hook("on_train_begin", start.epoch, epochs)  # rank 0 may rewrite metrics.jsonl
        for epoch in range(start.epoch, epochs):
            here = start if epoch == start.epoch else TrainPosition(epoch)
            first = self.plan.start_step(here.step, here.example)
            for cb in self.callbacks:
                cb.on_epoch_begin(epoch, steps, first)
            # The sums of the steps before `first` are global: they enter once, on rank 0.
            carried = self.objective.start_sums(here if here.mid_epoch else None)
            self._sums.assign(carried if self.ctx.is_chief else np.zeros_like(carried))
            if self.own_step is not None:  # the model's metric variables hold the sums
                self.objective.load(self._sums.numpy())
            began = time.perf_counter()
            for step, inputs, global_count in self._epoch_inputs(epoch, first, here.example):
                if self.backward_passes_per_step > 1:
                    global_count = self._update_mean_count(step)
                with in_collective(f"the allreduces of epoch {epoch + 1}, step {step + 1}"):
                    self.train_step(*inputs, np.float32(global_count))
                self.watchdog.beat(f"epoch {epoch + 1}, step {step + 1}")
                running = None
                if (step + 1) % self.log_every == 0:
                    running = checked(self._global_mean(self._sums.numpy(), "hvdtrain.running"), epoch, step)
                saving = any((step + 1) % every == 0 for every in save_every) and step + 1 < steps
                # Asked of every rank about once a second, at a step an update ends (mid-epoch).
                stop = stops is not None and stops.agreed(step + 1 < steps
                                                          and (step + 1) % self.backward_passes_per_step == 0)
                if saving or stop:
                    sums, non_finite = self._sums_and_state("hvdtrain.checkpoint_sums")
                    saveable(self.objective, sums, non_finite, epoch, step)  # never save a diverged state
                    position = TrainPosition(epoch, step + 1, self.plan.examples_before(step + 1), sums,
                                             self.objective.layout)
                    if saving:
                        self._write_hook("on_save_point", position)
                    if stop:
                        self._write_hook("on_stop", position)
                        raise Stopped(stop_signal(), f"epoch {epoch + 1}, step {step + 1} of {steps}")
                for cb in self.callbacks:
                    cb.on_step_end(epoch, step, running)
            sums, non_finite = self._sums_and_state("hvdtrain.train")
            elapsed = time.perf_counter() - began  # up to the epoch's last update and its metrics' allreduce
            # Checked before the evaluation, which NaN weights would spoil.
            train = saveable(self.objective, sums, non_finite, epoch, steps - 1)
            test = self.evaluate()
            if not np.isfinite(test.get("loss", 0.0)):  # finite variables, but outputs that overflow
                raise diverged(f"the global test loss is {test['loss']} after epoch {epoch + 1}")
            metrics = {
                **prefixed("train", train), **prefixed("test", test),
                "train_examples": train["count"],
                "images_per_sec": (train["count"] - self.objective.examples(carried)) / elapsed,
                "epoch_time_s": elapsed,
                "lr": last_learning_rate(self.optimizer),
                "world_size": self.ctx.size,
            }
            if self.loss_scale is not None:  # fp16: the scale now, and the steps skipped so far in the run
                metrics.update(loss_scale=float(self.loss_scale.scale.numpy()),
                               skipped_steps=int(self.loss_scale.skipped_steps.numpy()))
            self._write_hook("on_epoch_end", epoch, metrics)
            self.watchdog.beat(f"the end of epoch {epoch + 1}")
            if epoch + 1 < epochs and self._stop_requested(epoch):
                self.stopped_after = epoch + 1
                break
        for cb in self.callbacks:  # Keras' EarlyStopping restores its best weights here, before any save
            cb.on_train_end()
        if not metrics:  # nothing left to train (epochs reached): report the test metrics
            test = self.evaluate()
            metrics = {**prefixed("test", test), "world_size": self.ctx.size}
            self._write_hook("on_evaluation_only", start, metrics)
        if self.own_step is not None:  # the model's metrics held this rank's sums: every rank's model alike
            self.objective.load(np.zeros(self.objective.size))
        return metrics

