"""Side effects of training (printing, logging, checkpointing), as callbacks.

Callbacks marked ``chief_only = True`` run on rank 0 only: :func:`hvdtrain.train.run` creates them in
its one rank-0 block and :class:`hvdtrain.train.Trainer` refuses them on other ranks. No callback
runs a collective, so what they do cannot desynchronise the ranks.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Optional


class Callback:
    """Hooks called by :class:`hvdtrain.train.Trainer`. All metrics are already global (exact over ranks)."""

    chief_only = True

    def on_train_begin(self, start_epoch: int, epochs: int) -> None: ...

    def on_epoch_begin(self, epoch: int, steps: int, first_step: int = 0) -> None:
        """``steps`` per epoch; a resumed epoch begins at ``first_step``."""

    def on_step_end(self, epoch: int, step: int, running: Optional[dict]) -> None:
        """``running`` holds global running ``loss``/``accuracy`` on steps where they were reduced, else None."""

    def on_mid_epoch_checkpoint(self, epoch: int, steps_done: int, epoch_sums) -> None:
        """After ``steps_done`` steps of ``epoch``; ``epoch_sums`` are the global ``[loss, correct, count]`` so far."""

    def on_epoch_end(self, epoch: int, metrics: dict) -> None: ...

    def close(self) -> None: ...


class ProgressBar(Callback):
    """A tqdm bar per epoch with the global running loss and accuracy."""

    def __init__(self):
        self._bar = None

    def on_epoch_begin(self, epoch, steps, first_step=0):
        from tqdm import tqdm

        self._bar = tqdm(total=steps, initial=first_step, desc=f"epoch {epoch + 1}", unit="step", leave=False,
                         file=sys.stderr, dynamic_ncols=True, mininterval=1.0)

    def on_step_end(self, epoch, step, running):
        self._bar.update(1)
        if running:
            self._bar.set_postfix(loss=f"{running['loss']:.4f}", acc=f"{running['accuracy']:.4f}", refresh=False)

    def on_epoch_end(self, epoch, metrics):
        self.close()

    def close(self):
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class EpochLine(Callback):
    """One line per epoch on stdout."""

    def __init__(self, epochs: int):
        self.epochs = epochs

    def on_epoch_end(self, epoch, m):
        print(f"epoch {epoch + 1:>3}/{self.epochs}  train loss {m['train_loss']:.4f} acc {m['train_accuracy']:.4f}  "
              f"test loss {m['test_loss']:.4f} acc {m['test_accuracy']:.4f}  "
              f"{m['images_per_sec']:,.0f} img/s  {m['epoch_time_s']:.1f} s  lr {m['lr']:.4g}", flush=True)


class JsonlMetrics(Callback):
    """Appends one JSON object per epoch to ``<log_dir>/metrics.jsonl``.

    On a resumed run, lines of epochs after the resumed one (written by the interrupted run after
    its last checkpoint) are dropped first, so the file holds each epoch once.
    """

    def __init__(self, log_dir: str):
        self.path = os.path.join(log_dir, "metrics.jsonl")

    def on_train_begin(self, start_epoch, epochs):
        if not os.path.exists(self.path):
            return
        kept = []
        with open(self.path) as f:
            for line in f:
                try:
                    if json.loads(line).get("epoch", 0) <= start_epoch:
                        kept.append(line if line.endswith("\n") else line + "\n")
                except ValueError:  # a line cut short by a crash during its append
                    continue
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, self.path)

    def on_epoch_end(self, epoch, metrics):
        with open(self.path, "a") as f:
            f.write(json.dumps({"epoch": epoch + 1, **metrics}) + "\n")


class TensorBoard(Callback):
    """Scalars for TensorBoard under ``<log_dir>/tensorboard``: running metrics by step, epoch metrics by epoch."""

    def __init__(self, log_dir: str, steps_per_epoch: int):
        import tensorflow as tf

        self._tf = tf
        self._writer = tf.summary.create_file_writer(os.path.join(log_dir, "tensorboard"))
        self._steps_per_epoch = steps_per_epoch

    def on_step_end(self, epoch, step, running):
        if running:
            with self._writer.as_default(step=epoch * self._steps_per_epoch + step + 1):
                self._tf.summary.scalar("running/loss", running["loss"])
                self._tf.summary.scalar("running/accuracy", running["accuracy"])

    def on_epoch_end(self, epoch, metrics):
        with self._writer.as_default(step=epoch + 1):
            for key, value in metrics.items():
                self._tf.summary.scalar(f"epoch/{key}", value)
        self._writer.flush()

    def close(self):
        self._writer.close()


class Checkpointer(Callback):
    """Saves checkpoints at the end of every epoch, and within epochs when asked (rank 0 only; the
    state is identical on all ranks). Tagged by global step; ``epoch`` counts completed epochs."""

    def __init__(self, manager, meta: dict, steps_per_epoch: int):
        self.manager = manager
        self.meta = meta
        self.steps_per_epoch = steps_per_epoch

    def on_mid_epoch_checkpoint(self, epoch, steps_done, epoch_sums):
        self._save(tag=epoch * self.steps_per_epoch + steps_done,
                   meta={**self.meta, "epoch": epoch, "step_in_epoch": steps_done,
                         "epoch_sums": [float(v) for v in epoch_sums]})

    def on_epoch_end(self, epoch, metrics):
        self._save(tag=(epoch + 1) * self.steps_per_epoch,
                   meta={**self.meta, "epoch": epoch + 1, "step_in_epoch": 0, "metrics": metrics})

    def _save(self, tag, meta):
        from hvdtrain.errors import HvdtrainError

        try:
            self.manager.save(tag=tag, meta=meta)
        except OSError as e:  # disk full, directory removed...: the previous checkpoints are intact
            raise HvdtrainError(f"cannot write checkpoint {tag} in {self.manager.directory}: {e}") from None
