"""The run directory (metrics, TensorBoard logs, checkpoints) and what ``--resume`` reads from it.

Rank 0 alone calls these functions; the recipe agrees on their outcome with the other ranks.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import List, Optional

from hvdtrain.callbacks import logged_epochs
from hvdtrain.checkpoint import CheckpointManager, check_resumable, require_checkpoint_dir
from hvdtrain.config import Config
from hvdtrain.config_file import config_to_yaml
from hvdtrain.errors import HvdtrainError, describe_differences
from hvdtrain.console import say
from hvdtrain.files import refuse_a_file_in_the_way, replace_file
from hvdtrain.position import TrainPosition


def default_run_dir() -> str:
    """``runs/<date>-<time>``, the run directory without ``--log-dir`` (rank 0's name is broadcast)."""
    return os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))


def checkpoint_dir(config: Config, run_dir: str) -> str:
    """``--checkpoint-dir``, or ``<run_dir>/checkpoints``."""
    return config.checkpoint.dir or os.path.join(run_dir, "checkpoints")


def checkpoint_meta(config: Config, world_size: int, steps_per_epoch: int, fingerprint: dict,
                    elastic: bool = False) -> dict:
    """What every checkpoint's ``meta.json`` records of the run besides its position: the model,
    the layout of the global batches (world size, local batch, steps per epoch, seed, the data's
    fingerprint) and the whole config."""
    meta = {"model": config.model.name, "world_size": world_size, "batch_size": config.batch_size,
            "steps_per_epoch": steps_per_epoch, "seed": config.seed, "data": fingerprint}
    if elastic:
        meta["elastic"] = True
    return {**meta, "config": config.to_dict()}


def open_run_dir(config: Config, run_dir: str, ckpt_dir: str, model, optimizer, fresh: bool,
                 must_exist: bool = False) -> CheckpointManager:
    """Create the run directory and the checkpoint manager (the run's settings are written by
    :func:`write_run_config` once a resumed checkpoint has been checked).

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


def write_run_config(config: Config, run_dir: str) -> None:
    """Write the settings this run runs with to ``<run_dir>/config.yaml`` (``--config`` reads it
    back), atomically, with ``resume: false``: the file starts this run again, and ``--resume``
    given with it continues it. Called after any ``--resume`` checks: a refused resume leaves the
    file of the run it refused untouched."""
    rerun = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, resume=False))
    replace_file(os.path.join(run_dir, "config.yaml"), config_to_yaml(rerun))


def restore_for_resume(config: Config, manager: CheckpointManager, run_dir: Optional[str], expected: dict,
                       num_examples: int, elastic: bool = False) -> TrainPosition:
    """``--resume``: restore the latest checkpoint into the manager's model and optimizer and
    return its position; the start, if the checkpoint directory holds none yet.

    Args:
        expected: what the checkpoint's run must share with this one (:func:`check_resumable`):
            a static run continues the same sequence of global batches (world size, local batch,
            steps per epoch, seed, data); an elastic job, counted in examples, may change the world size.
        num_examples: training examples (for checkpoints that predate ``example_in_epoch``).
        elastic: this run is an elastic job (which may resume an elastic job's checkpoints).

    Raises:
        HvdtrainError: an unreadable checkpoint, one of another run (naming what differs), an
            elastic job's checkpoint resumed without ``--elastic``, or none though the run's
            metrics record more than one epoch.
    """
    if manager.latest() is None:
        start_without_checkpoint(manager.directory, run_dir)
        return TrainPosition()
    refuse_other_optimizer_state(config, manager.latest())
    latest, meta = manager.restore_latest()
    if meta.get("elastic") and not elastic:
        raise HvdtrainError(f"--resume: {latest} was written by an elastic job, whose steps mix world sizes; "
                            f"resume it with --elastic")
    check_resumable(latest, meta, expected)
    changed = changed_settings(config, meta.get("config"))
    if config.epochs <= int(meta["epoch"]):  # evaluation only: fewer epochs asked for is no change to report
        changed = [c for c in changed if not c.startswith("epochs:")]
    if changed:  # allowed (a longer run, a lower rate), but the run is no longer the one checkpointed
        say(f"--resume: settings changed since {os.path.basename(latest)}: {'; '.join(changed)}")
    return TrainPosition.from_meta(meta, num_examples)


def refuse_other_optimizer_state(config: Config, checkpoint: str) -> None:
    """Refuse to resume a checkpoint whose optimizer state does not fit this run's: SGD's slots
    (momentum) against Adam's and AdamW's (first and second moments), or fp16's loss scale, which
    is part of the optimizer's state (:class:`hvdtrain.precision.DynamicLossScale`), against none.

    Raises:
        HvdtrainError: naming the checkpoint's setting. An unreadable ``meta.json`` is left to the
            restore, which names the damage.
    """
    try:
        with open(os.path.join(checkpoint, "meta.json")) as f:
            saved = json.load(f)["config"]
        optimizer = saved.get("optim", {}).get("name", "sgd")  # checkpoints before --optimizer: SGD
        precision = saved.get("compute", {}).get("precision", "fp32")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return
    if (optimizer == "sgd") != (config.optim.name == "sgd"):
        raise HvdtrainError(f"--resume: {checkpoint} was written with --optimizer {optimizer}, whose state does not fit "
                            f"--optimizer {config.optim.name}'s; resume with --optimizer {optimizer}")
    if (precision == "fp16") != (config.compute.precision == "fp16"):
        raise HvdtrainError(f"--resume: {checkpoint} was written with --precision {precision}, this run has --precision "
                            f"{config.compute.precision}: fp16's loss scale is part of the optimizer's state; resume "
                            f"with --precision {precision}" + ("" if precision == "fp16" else " or bf16"))


def start_without_checkpoint(ckpt_dir: str, run_dir: Optional[str]) -> None:
    """``--resume`` with a checkpoint directory that holds no checkpoint: the run stopped before
    its first save (what a requeued job meets), so it starts from the beginning -- unless its
    ``metrics.jsonl`` records more than one finished epoch: then its checkpoints were removed, and
    starting over would overwrite its metrics. (One epoch may be logged without its checkpoint,
    by a stop between the two.)

    Raises:
        HvdtrainError: if ``run_dir``'s metrics record an epoch after the first.
    """
    metrics_file = os.path.join(run_dir, "metrics.jsonl") if run_dir else ""
    logged = logged_epochs(metrics_file) if os.path.isfile(metrics_file) else []
    epochs = max((epoch for epoch, _ in logged), default=0)
    if epochs > 1:
        raise HvdtrainError(f"--resume: no checkpoint in {ckpt_dir}, but {metrics_file} records {epochs} epochs: "
                            f"that run's checkpoints were removed; choose another --log-dir to start over")
    say(f"--resume: no checkpoint in {ckpt_dir} yet (the run stopped before its first save); "
        f"starting from the beginning")


def changed_settings(config: Config, saved: Optional[dict]) -> List[str]:
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
