"""Your own training loop on N ranks: the pieces of hvdtrain's loop that a GradientTape loop with
Horovod's own API needs (a GAN's two optimizers, say), exact as hvdtrain's are.

* :func:`rank_batches`: this rank's exact shard of each global batch of an epoch (each example once
  per epoch over all ranks, equal steps on every rank; :class:`hvdtrain.ShardPlan`), with the weight
  that makes Horovod's average of the ranks' mean losses the global batch's mean loss.
* :func:`global_results`: Keras metrics over all ranks, from their variables (sums and counts)
  allreduced: the value one process would get on every example, never a mean of the ranks' means.
* :class:`Checkpoints`: written by rank 0 alone, restored on every rank by broadcast.

``docs/loop.md`` shows them in a loop; ``examples/gan_loop.py`` runs one.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import time
from typing import Dict, Iterator, Optional, Sequence

import numpy as np
import tensorflow as tf

from hvdtrain import kerases
from hvdtrain.data.examples import leaf_paths, path_name
from hvdtrain.data.sharding import ShardPlan
from hvdtrain.ending import QUIET_EXIT_DELAY_S
from hvdtrain.errors import FoundHere, HvdtrainError, PeerFailure
from hvdtrain.keras_step import offset_seed_generators
from hvdtrain.runtime.dist import DistContext, tf_variable


@dataclasses.dataclass(frozen=True)
class LocalBatch:
    """One rank's part of one global batch.

    Attributes:
        step: the step in the epoch, ``[0, plan.steps_per_epoch)``.
        examples: the data's nest, each leaf's rows for this rank: first dimension ``local_size``.
        local_size: examples on this rank (the ranks' sizes differ by at most 1 on a short step).
        global_size: examples over all ranks at this step.
        world_size: ranks.
    """

    step: int
    examples: object
    local_size: int
    global_size: int
    world_size: int

    @property
    def loss_weight(self) -> float:
        """``local_size * world_size / global_size``: this rank's mean loss times it, averaged over
        ranks (``hvd.DistributedGradientTape``'s default), is the global batch's mean loss, also on
        a step whose local batches differ in size. 1.0 on every full step."""
        return self.local_size * self.world_size / self.global_size


def _rows(leaf, indices: np.ndarray):
    if isinstance(leaf, np.ndarray):
        return leaf[indices]
    return tf.gather(leaf, indices)  # tensors, ragged tensors


def rank_batches(data, plan: ShardPlan, epoch: int) -> Iterator[LocalBatch]:
    """This rank's local batch of each step of ``epoch``, in order (the data checked at the call).

    Step ``s`` over all ranks holds the examples one process at batch ``plan.global_batch`` takes at
    step ``s``, but in one case: when the epoch's last global batch would hold fewer examples than
    there are ranks, they join the step before it (a rank never gets an empty batch; see
    :mod:`hvdtrain.data.sharding`).

    Args:
        data: a nest (tuple, list, dict) of arrays or tensors whose first dimension is the example,
            ``plan.num_examples`` rows each, the same on every rank (per-example noise a GAN draws
            belongs here too: then N ranks draw what one process draws).
        plan: ``ShardPlan(num_examples, local_batch, ctx.size, ctx.rank, seed)``.
        epoch: 0-based; the epoch's order is a function of ``(plan.seed, epoch)`` alone.

    Yields:
        :class:`LocalBatch`, ``plan.steps_per_epoch`` of them.

    Raises:
        ValueError: if a leaf has another number of rows than ``plan.num_examples``, or there are
            fewer examples than ranks (a rank's batch would be empty).
    """
    for path, leaf in leaf_paths(data):
        shape = getattr(leaf, "shape", ())
        rows = shape[0] if len(shape) else None
        if rows != plan.num_examples:
            raise ValueError(f"rank_batches: {path_name('data', path)} has {rows} rows, the plan "
                             f"{plan.num_examples} examples")
    if plan.num_examples < plan.world_size:
        raise ValueError(f"rank_batches: {plan.num_examples} examples for {plan.world_size} ranks: a rank's batch "
                         f"would be empty")
    return _batches(data, plan, plan.permutation(epoch))


def _batches(data, plan: ShardPlan, order: np.ndarray) -> Iterator[LocalBatch]:
    for step in range(plan.steps_per_epoch):
        indices = order[plan.local_slice(step)]
        yield LocalBatch(step, tf.nest.map_structure(lambda leaf: _rows(leaf, indices), data), len(indices),
                         plan.global_batch_size(step), plan.world_size)


def global_results(ctx: DistContext, metrics: Sequence) -> Dict[str, object]:
    """Each Keras metric's ``result()`` over all ranks (a collective: every rank calls it alike).

    Keras' built-in metrics keep sums in their variables (a ``Mean``'s total and count, an
    accuracy's correct count and count, a confusion matrix): they are read as one float64 vector,
    allreduced (summed), loaded into the metrics for ``result()``, and put back, so the local state
    is as it was. A metric of your own is exact so only if its variables are sums too.

    Args:
        ctx: the job (:func:`hvdtrain.init_distributed`).
        metrics: Keras 2 or Keras 3 metrics, the same list on every rank.

    Returns:
        ``{metric.name: float}`` (an ``np.ndarray`` for a vector result).

    Raises:
        ValueError: for two metrics of one name.
        HvdtrainError: on every rank, where the ranks' metrics hold variables of other shapes (one
            that builds its variables at its first update, and was never updated on some rank).
    """
    names = [m.name for m in metrics]
    if len(set(names)) < len(names):
        raise ValueError(f"global_results: metrics of one name: {sorted(n for n in set(names) if names.count(n) > 1)}")
    if not metrics:
        return {}
    variables = [tf_variable(v) for m in metrics for v in m.variables]
    layout = [(m.name, tuple(v.shape)) for m in metrics for v in m.variables]
    layouts = ctx.allgather_object(layout, name="hvdtrain.loop.global_results.layout")
    if any(other != layout for other in layouts):
        odd = next(r for r, other in enumerate(layouts) if other != layouts[0])
        raise HvdtrainError(f"global_results: rank {odd}'s metric variables differ from rank 0's "
                            f"({layouts[odd]} against {layouts[0]}): update every metric on every rank")
    saved = [v.numpy() for v in variables]
    local = np.concatenate([np.ravel(s).astype(np.float64) for s in saved]) if saved else np.zeros(0)
    total = ctx.allreduce_sum(local, name="hvdtrain.loop.global_results")
    offset = 0
    try:
        for v, s in zip(variables, saved):
            v.assign(total[offset:offset + s.size].reshape(s.shape).astype(s.dtype))
            offset += s.size
        results = {m.name: np.asarray(m.result()) for m in metrics}
    finally:
        for v, s in zip(variables, saved):
            v.assign(s)
    return {k: float(r) if r.size == 1 else r for k, r in results.items()}


def _unbuilt_optimizer(obj) -> bool:
    """A Keras 3 optimizer, or Keras 2's (tf_keras.optimizers), whose slots are not created yet.
    (Keras 2's legacy optimizers create theirs at their first step and cannot be told.)"""
    if not hasattr(obj, "apply_gradients") or not hasattr(obj, "build"):
        return False
    built = getattr(obj, "built", None)
    return not (getattr(obj, "_built", False) if built is None else built)


def _variables_of(obj) -> list:
    """A model's or an optimizer's variables (Keras 2's optimizers list them by a method), or ``[obj]``."""
    if isinstance(obj, tf.Variable) or not hasattr(obj, "variables"):
        return [obj]
    found = obj.variables
    return list(found() if callable(found) else found)


class Checkpoints:
    """Checkpoints of a loop's state, written by rank 0 alone and restored on every rank.

    Rank 0 writes through ``tf.train.CheckpointManager`` (each checkpoint complete before the
    ``checkpoint`` index names it, the newest ``keep`` kept); the other ranks never touch the
    directory, so it may be rank 0's local disk. Both methods are collectives: every rank calls them
    at the same point, and an error on rank 0 is raised on every rank instead of leaving the others
    waiting.

    Args:
        ctx: the job (:func:`hvdtrain.init_distributed`).
        directory: rank 0's checkpoint directory (made at the first save).
        keep: newest checkpoints kept (>= 1).
        **objects: what a checkpoint holds, by name: Keras models and optimizers (built, so that
            their slots are saved: ``optimizer.build(model.trainable_variables)``), ``tf.Variable``\\ s.

    Raises:
        HvdtrainError: ``keep`` < 1, no objects, or an optimizer that is not built (Keras 3's, or
            Keras 2's ``tf_keras.optimizers``; Keras 2's legacy ones create their slots at their
            first step: restore after it).
    """

    def __init__(self, ctx: DistContext, directory: str, keep: int = 3, **objects):
        if keep < 1 or not objects:
            raise HvdtrainError(f"Checkpoints: keep must be >= 1 (got {keep}) and something to save "
                                f"(got {sorted(objects)})")
        for name, obj in objects.items():
            if _unbuilt_optimizer(obj):
                raise HvdtrainError(f"Checkpoints: optimizer {name!r} is not built, so its slots would be missing: "
                                    f"call {name}.build(model.trainable_variables) first")
        self.ctx, self.directory, self.objects = ctx, directory, objects
        tracked = dict(objects)
        # Keras 3 keeps layers held in a list or dict of a subclassed model out of TensorFlow's
        # object graph: a model's variables, listed too, are all saved.
        tracked.update({f"{name}_variables": list(obj.variables) for name, obj in objects.items()
                        if kerases.version_of(obj) == 3 and hasattr(obj, "layers")})
        self._checkpoint = tf.train.Checkpoint(**tracked)
        self._manager = tf.train.CheckpointManager(self._checkpoint, directory, max_to_keep=keep) \
            if ctx.is_chief else None

    def _on_rank_0(self, what: str, fn):
        try:
            return self.ctx.guarded(what, fn if self.ctx.is_chief else lambda: None)
        except FoundHere as e:
            raise e.error from None
        except PeerFailure as e:
            # A launcher ends the job at the first rank's exit: rank 0 prints its error first.
            time.sleep(QUIET_EXIT_DELAY_S)
            raise HvdtrainError(f"{e} (rank 0 says why)") from None

    def restore(self) -> int:
        """Every rank's state from rank 0: the newest checkpoint's, or rank 0's own values where
        there is none (the broadcast of the initial state). Returns the number the checkpoint was
        saved with (0 without one).

        Raises:
            HvdtrainError: on every rank, if rank 0 cannot read the newest checkpoint (it names it).
        """
        def load() -> int:
            path = self._manager.latest_checkpoint
            if path is None:
                left = sorted(glob.glob(os.path.join(self.directory, "ckpt-*.index")))
                if left:  # tf.train.CheckpointManager ignores a damaged or missing index: no silent restart
                    raise HvdtrainError(f"checkpoints {', '.join(map(os.path.basename, left))} are in "
                                        f"{self.directory}, but its 'checkpoint' index names none (damaged or missing)")
                return 0
            try:
                self._checkpoint.read(path).assert_existing_objects_matched()
            except Exception as e:  # noqa: BLE001 -- the reader raises OpError, ValueError... on damage
                lines = str(e).strip().splitlines()
                raise HvdtrainError(f"checkpoint {path} is corrupt or of other objects: "
                                    f"{lines[0] if lines else type(e).__name__}") from None
            return int(path.rsplit("-", 1)[1])

        number = self.ctx.broadcast_object(self._on_rank_0(f"restoring a checkpoint of {self.directory}", load),
                                           name="hvdtrain.loop.checkpoint_number")
        variables = [v for obj in self.objects.values() for v in _variables_of(obj)]
        self.ctx.broadcast_variables(variables, name="the broadcast of the loop's state")
        offset_seed_generators(variables, self.ctx.rank)  # each rank its own Dropout masks, noise
        return number

    def save(self, number: int) -> Optional[str]:
        """Rank 0 writes checkpoint ``number`` (the step, say: it must grow); returns its path on
        rank 0, None elsewhere.

        Raises:
            HvdtrainError: on every rank, if rank 0 cannot write it.
        """
        def write() -> str:
            try:
                return self._manager.save(checkpoint_number=number)
            except (OSError, tf.errors.OpError) as e:
                raise HvdtrainError(f"cannot write a checkpoint to {self.directory}: "
                                    f"{getattr(e, 'message', e)}") from None

        return self._on_rank_0(f"saving a checkpoint to {self.directory}", write)
