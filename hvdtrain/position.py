"""Where a run is: the one training position that checkpoints, resumes and elastic commits share."""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple


@dataclasses.dataclass(frozen=True)
class TrainPosition:
    """How far training has come: ``epoch`` epochs done, and so far into the next.

    Attributes:
        epoch: completed epochs (int >= 0).
        step: steps of the next epoch done, at the world size that ran them (int >= 0). A static
            run resumes at this step of the same shard plan.
        example: examples of the next epoch's permutation trained (int in ``[0, num_examples]``);
            an elastic job, whose world size changes, resumes at this example.
        epoch_sums: the global float sums of those examples' loss and metrics
            (:class:`hvdtrain.task.Objective`), or None at an epoch's start, so that a resumed
            epoch's metrics stay exact.
        sums_layout: what each of ``epoch_sums`` is (:attr:`hvdtrain.task.Objective.layout`),
            or None where unknown (positions from before it was recorded).
    """

    epoch: int = 0
    step: int = 0
    example: int = 0
    epoch_sums: Optional[Tuple[float, ...]] = None
    sums_layout: Optional[Tuple[str, ...]] = None

    def __post_init__(self):
        if self.epoch_sums is not None:
            object.__setattr__(self, "epoch_sums", tuple(float(v) for v in self.epoch_sums))
        if self.sums_layout is not None:
            object.__setattr__(self, "sums_layout", tuple(self.sums_layout))

    @property
    def mid_epoch(self) -> bool:
        """True when the position is inside an epoch, not at its start."""
        return bool(self.step or self.example)

    def to_meta(self, sums: bool = True) -> dict:
        """The position as a checkpoint's ``meta.json`` (and ``evaluation.json``) keys:
        ``epoch``, ``step_in_epoch``, ``example_in_epoch`` and (mid-epoch, if ``sums``) ``epoch_sums``."""
        meta = {"epoch": self.epoch, "step_in_epoch": self.step, "example_in_epoch": self.example}
        if sums and self.epoch_sums is not None:
            meta["epoch_sums"] = list(self.epoch_sums)
            if self.sums_layout is not None:
                meta["epoch_sums_layout"] = list(self.sums_layout)
        return meta

    @classmethod
    def from_meta(cls, meta: dict, num_examples: int) -> "TrainPosition":
        """The position a checkpoint's ``meta.json`` records.

        Checkpoints written before ``example_in_epoch`` existed give it from the step and the
        global batch they record (``world_size x batch_size``), capped at ``num_examples``. Those
        written before losses and metrics could be chosen hold ``(loss sum, correct, count)``
        sums, which become the default objective's ``(loss sum, count, correct, count)``.
        """
        step = int(meta.get("step_in_epoch", 0))
        example = meta.get("example_in_epoch")
        if example is None:
            example = min(step * int(meta.get("world_size", 1)) * int(meta.get("batch_size", 0)), num_examples)
        sums = meta.get("epoch_sums")
        layout = meta.get("epoch_sums_layout")
        if sums is not None and len(sums) == 3 and "task" not in meta.get("config", {}):
            sums = [sums[0], sums[2], sums[1], sums[2]]
            layout = ["sparse_categorical_crossentropy", "accuracy:2"]
        return cls(epoch=int(meta["epoch"]), step=step, example=int(example), epoch_sums=sums, sums_layout=layout)
