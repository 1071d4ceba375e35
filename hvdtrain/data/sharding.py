"""Which examples each rank reads at each step: disjoint, complete shards with equal step counts.

Each epoch is one global shuffle of the training set (the same on every rank: it depends only on
the seed and the epoch), cut into consecutive global batches of ``world_size · local_batch``
examples; rank ``r`` takes the ``r``-th of ``world_size`` contiguous slices of each global batch.
So, per epoch:

* the ranks' shards are disjoint and together are the whole training set (no example dropped or
  repeated, whatever the training-set size);
* every rank runs the same number of steps, ``ceil(n / global_batch)`` (one fewer in the case
  below): the last, short global batch is split as evenly as possible, so a rank may get a short
  local batch but never skips a step and never leaves the others waiting in a collective;
* no rank gets an empty local batch: when the epoch's last global batch would hold fewer examples
  than there are ranks, those examples join the step before it (``global_batch + r`` examples,
  ``local_batch`` or ``local_batch + 1`` per rank), and the epoch has one step fewer. An empty
  batch is not safe in a real model: under oneDNN (TensorFlow's CPU default) ``Conv2D`` returns a
  wrongly shaped tensor for a batch of 0, and Keras' ``BatchNormalization`` sets its moving
  statistics to NaN;
* step ``s`` over all ranks covers exactly the examples that one process with batch
  ``world_size · local_batch`` takes at step ``s`` -- the basis of the equivalence with
  single-process training -- except in that one case, where the single process would take the
  last few examples in a step of their own.

An elastic job (:mod:`hvdtrain.elastic`) that changes world size mid-epoch continues from the
position ``first_example`` the old world size reached: the first step takes the examples up to the
next multiple of the new global batch (a short step, exact because the loss is scaled by the
global count), and the steps after it are aligned as above. A short first step with fewer
examples than ranks joins the step after it; if it is the epoch's last, its examples (fewer than
``world_size``) are not trained on in that epoch.
"""
from __future__ import annotations

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
        self._span_cache = {}

    @property
    def global_batch(self) -> int:
        """``world_size · local_batch``: examples per optimizer step over all ranks."""
        return self.world_size * self.local_batch

    @property
    def steps_per_epoch(self) -> int:
        """Steps in a whole epoch, identical on every rank: ``ceil(num_examples / global_batch)``, or
        one fewer when the last global batch would have fewer examples than ranks (see the module)."""
        full, rest = divmod(self.num_examples, self.global_batch)
        joins_the_step_before = 0 < rest < self.world_size and full >= 1
        return full + int(rest > 0 and not joins_the_step_before)

    def permutation(self, epoch: int) -> np.ndarray:
        """The epoch's global example order, int64 ``(num_examples,)``, identical on every rank."""
        if not self.shuffle:
            return np.arange(self.num_examples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)

    def _spans(self, first_example: int = 0) -> dict:
        """``{step: (start, end)}``: the positions in the epoch's permutation that all ranks take at
        each step of an epoch begun at position ``first_example`` (computed once per position)."""
        if first_example not in self._span_cache:
            if not 0 <= first_example <= self.num_examples:
                raise ValueError(f"first_example {first_example} outside [0, {self.num_examples}]")
            steps, g = self.steps_per_epoch, self.global_batch
            spans = {s: (max(s * g, first_example), self.num_examples if s == steps - 1 else (s + 1) * g)
                     for s in range(first_example // g, steps)}
            spans = {s: span for s, span in spans.items() if span[1] > span[0]}
            first = min(spans, default=None)
            if first is not None and spans[first][1] - spans[first][0] < min(self.world_size, self.num_examples):
                start, _ = spans.pop(first)  # too few examples for every rank to get one
                if first + 1 in spans:
                    spans[first + 1] = (start, spans[first + 1][1])
            self._span_cache[first_example] = spans
        return self._span_cache[first_example]

    def global_batch_size(self, step: int, first_example: int = 0) -> int:
        """Examples over all ranks at ``step``: ``global_batch``, except a different last step (and a
        different first step when the epoch resumes at an unaligned ``first_example``)."""
        start, end = self._spans(first_example)[step]
        return end - start

    def local_slice(self, step: int, rank: int = None, first_example: int = 0) -> slice:
        """Positions in the epoch's permutation that ``rank`` (default: this rank) takes at ``step``."""
        return self._local(*self._spans(first_example)[step], self.rank if rank is None else rank)

    def _local(self, start: int, end: int, rank: int) -> slice:
        """``rank``'s contiguous part of the positions ``[start, end)`` (sizes differ by <= 1)."""
        size = end - start
        return slice(start + rank * size // self.world_size, start + (rank + 1) * size // self.world_size)

    def examples_before(self, step: int) -> int:
        """Position in the epoch's permutation after ``step`` whole steps (``num_examples`` after the last)."""
        return self.num_examples if step >= self.steps_per_epoch else step * self.global_batch

    def start_step(self, first_step: int = 0, first_example: int = 0) -> int:
        """The step an epoch resumed at ``first_step`` or position ``first_example`` begins with:
        the step holding ``first_example`` (the one after it, if its part would give some rank no
        example), or ``first_step`` if later; ``steps_per_epoch`` if none is left."""
        return min((s for s in self._spans(first_example) if s >= first_step), default=self.steps_per_epoch)

    def epoch(self, epoch: int, first_step: int = 0, first_example: int = 0):
        """Yield ``(step, local_indices, global_batch_size)`` for the rest of ``epoch``.

        It starts at :meth:`start_step` ``(first_step, first_example)``; a step that holds
        ``first_example`` begins there.

        ``local_indices`` is int32 ``(b,)``: ``b == local_batch``, except at the last step
        (``1 <= b <= local_batch + 1``) and at the first step of an epoch resumed at an unaligned
        ``first_example`` (``1 <= b <= local_batch + 2``). ``b`` is 0 only when the whole training
        set has fewer examples than ranks.

        Raises:
            ValueError: if ``first_example`` is outside ``[0, num_examples]``.
        """
        order = self.permutation(epoch).astype(np.int32)
        for step, (start, end) in sorted(self._spans(first_example).items()):
            if step >= first_step:
                yield step, order[self._local(start, end, self.rank)], end - start


def eval_shard(num_examples: int, world_size: int, rank: int) -> slice:
    """The contiguous slice of an evaluation set that ``rank`` evaluates (sizes differ by <= 1).

    Evaluation runs no collective per batch, so ranks may run different batch counts; each example
    is counted once over all ranks.
    """
    return slice(rank * num_examples // world_size, (rank + 1) * num_examples // world_size)
