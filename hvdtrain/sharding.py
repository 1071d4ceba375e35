"""Which examples each rank reads at each step: disjoint, complete shards with equal step counts.

Each epoch is one global shuffle of the training set (the same on every rank: it depends only on
the seed and the epoch), cut into consecutive global batches of ``world_size · local_batch``
examples; rank ``r`` takes the ``r``-th of ``world_size`` contiguous slices of each global batch.
So, per epoch:

* the ranks' shards are disjoint and together are the whole training set (no example dropped or
  repeated, whatever the training-set size);
* every rank runs the same number of steps, ``ceil(n / global_batch)``: the last, short global
  batch is split as evenly as possible, so a rank may get a short (or, when fewer examples than
  ranks remain, empty) local batch but never skips a step and never leaves the others waiting in
  a collective;
* step ``s`` over all ranks covers exactly the examples that one process with batch
  ``world_size · local_batch`` takes at step ``s`` -- the basis of the equivalence with
  single-process training.
"""
from __future__ import annotations

import math

import numpy as np


class ShardPlan:
    """The per-epoch, per-step local batches of one rank.

    Args:
        num_examples: training-set size ``n`` (>= 1).
        local_batch: examples per rank per step ``B`` (>= 1).
        world_size: number of ranks ``R`` (>= 1).
        rank: this rank, ``[0, R)``.
        seed: shuffle seed; the permutation of epoch ``e`` is a function of ``(seed, e)`` only.
        shuffle: False keeps the dataset order (for tests and oracles).

    Raises:
        ValueError: for sizes < 1 or a rank out of range.
    """

    def __init__(self, num_examples: int, local_batch: int, world_size: int, rank: int,
                 seed: int = 0, shuffle: bool = True):
        if num_examples < 1 or local_batch < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"bad shard plan: num_examples={num_examples}, local_batch={local_batch}, "
                             f"world_size={world_size}, rank={rank}")
        self.num_examples = num_examples
        self.local_batch = local_batch
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle

    @property
    def global_batch(self) -> int:
        """``world_size · local_batch``: examples per optimizer step over all ranks."""
        return self.world_size * self.local_batch

    @property
    def steps_per_epoch(self) -> int:
        """``ceil(num_examples / global_batch)``, identical on every rank."""
        return math.ceil(self.num_examples / self.global_batch)

    def permutation(self, epoch: int) -> np.ndarray:
        """The epoch's global example order, int64 ``(num_examples,)``, identical on every rank."""
        if not self.shuffle:
            return np.arange(self.num_examples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)

    def global_batch_size(self, step: int) -> int:
        """Examples over all ranks at ``step``: ``global_batch``, except a shorter last step."""
        return min(self.global_batch, self.num_examples - step * self.global_batch)

    def local_slice(self, step: int, rank: int = None) -> slice:
        """Positions in the epoch's permutation that ``rank`` (default: this rank) takes at ``step``."""
        rank = self.rank if rank is None else rank
        start, size = step * self.global_batch, self.global_batch_size(step)
        return slice(start + rank * size // self.world_size, start + (rank + 1) * size // self.world_size)

    def epoch(self, epoch: int, first_step: int = 0):
        """Yield ``(step, local_indices, global_batch_size)`` for the steps of ``epoch`` from ``first_step``.

        ``local_indices`` is int32 ``(b,)`` with ``0 <= b <= local_batch`` (``b == local_batch``
        except possibly at the last step).
        """
        order = self.permutation(epoch).astype(np.int32)
        for step in range(first_step, self.steps_per_epoch):
            yield step, order[self.local_slice(step)], self.global_batch_size(step)


def eval_shard(num_examples: int, world_size: int, rank: int) -> slice:
    """The contiguous slice of an evaluation set that ``rank`` evaluates (sizes differ by <= 1).

    Evaluation runs no collective per batch, so ranks may run different batch counts; each example
    is counted once over all ranks.
    """
    return slice(rank * num_examples // world_size, (rank + 1) * num_examples // world_size)
