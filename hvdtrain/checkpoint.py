"""Atomic checkpoints written by rank 0 and restored on rank 0, then broadcast to every rank.

Layout of a checkpoint directory::

    ckpt-000470/            state after global step 470 (complete: it only appears by rename)
        state.index         tf.train.Checkpoint of the model and optimizer (no pickle)
        state.data-00000-of-00001
        meta.json           completed epochs, step within the epoch, the epoch's metric sums so far,
                            world size, local batch, steps per epoch, model, seed, the data's
                            fingerprint, variable shapes
    ckpt-000940/
    .tmp-ckpt-001410-<pid>/ a save in progress or interrupted: ignored, removed by the next save

A save writes everything into a temporary directory, fsyncs it and renames it into place, so a
crash at any moment leaves the previous checkpoints complete and loadable.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Optional

import tensorflow as tf

from hvdtrain import kerases
from hvdtrain.errors import HvdtrainError, describe_differences
from hvdtrain.files import fsync_dir, refuse_a_file_in_the_way

_NAME = re.compile(r"^ckpt-(\d{6,})$")
FORMAT_VERSION = 1


def variable_signature(model) -> list:
    """The shapes of the model's variables, in order, to recognise a checkpoint of another model.

    (Shapes, not names: Keras numbers layer names per process, so names vary between runs.)
    """
    return [list(v.shape) for v in model.variables]


def check_resumable(path: str, meta: dict, expected: dict) -> None:
    """Refuse to resume from a checkpoint written by a run that differs in ``expected``'s keys.

    Args:
        path: the checkpoint, for the message.
        meta: its ``meta.json``.
        expected: this run's values of what a resumed run must keep, e.g. ``{"batch_size": 128,
            "seed": 0, "data": Dataset.fingerprint()}``: a resumed run continues the same
            sequence of global batches, drawn from the same permutations of the same examples.

    Raises:
        HvdtrainError: naming each differing key (and sub-key) with both values.
    """
    # A key the checkpoint lacks was written before hvdtrain recorded it: nothing to compare.
    differences = describe_differences({k: v for k, v in expected.items() if k in meta}, meta, "there")
    if differences:
        raise HvdtrainError(f"--resume: {path} was written by a run with other settings or data "
                            f"({'; '.join(differences)}); resume with the same ones")


def damaged_file(path: str) -> str:
    """``"<file> is damaged: "``: the file of checkpoint ``path`` that cannot be read (the index,
    or the data file holding a tensor that cannot be read), or ``""`` where every file reads."""
    import tensorflow as tf

    prefix = os.path.join(path, "state")
    try:
        reader = tf.train.load_checkpoint(prefix)
    except Exception:  # noqa: BLE001 -- any failure to read the index
        return f"{prefix}.index is damaged: "
    for name in reader.get_variable_to_shape_map():
        try:
            reader.get_tensor(name)
        except Exception:  # noqa: BLE001 -- a tensor that cannot be read lies in a damaged data file
            data = sorted(f for f in os.listdir(path) if f.startswith("state.data-"))
            return f"{', '.join(os.path.join(path, f) for f in data)} (tensor {name}) is damaged: "
    return ""


def completed_checkpoints(directory: str) -> list:
    """The complete checkpoints in ``directory`` as ``[(tag, path), ...]``, oldest first (none if it
    does not exist)."""
    found = []
    for name in (os.listdir(directory) if os.path.isdir(directory) else []):
        match = _NAME.match(name)
        path = os.path.join(directory, name)
        if match and os.path.isfile(os.path.join(path, "meta.json")):
            found.append((int(match.group(1)), path))
    return sorted(found)


class DamagedCheckpoint(HvdtrainError):
    """A checkpoint whose files cannot be read back (truncated, corrupt, unparsable metadata)."""


def require_checkpoint_dir(directory: str) -> None:
    """Refuse a ``--resume`` whose checkpoint directory does not exist, before anything creates it.

    Raises:
        HvdtrainError: naming the directory.
    """
    _refuse_a_file(directory)
    if not os.path.isdir(directory):
        raise HvdtrainError(f"--resume: no checkpoint directory {directory} (check --log-dir/--checkpoint-dir)")


def _refuse_a_file(directory: str) -> None:
    """Raise HvdtrainError if the checkpoint directory, or a directory above it, is a file."""
    refuse_a_file_in_the_way(directory, "checkpoint directory", "check --log-dir/--checkpoint-dir")


class CheckpointManager:
    """Saves and restores ``tf.train.Checkpoint(model=..., optimizer=...)`` plus JSON metadata.

    Only the chief (rank 0) constructs one (see :func:`hvdtrain.recipe.run`); the restored state
    reaches the other ranks by broadcast, so only rank 0 needs the directory.

    Args:
        directory: the checkpoint directory (created if missing).
        model: the Keras model.
        optimizer: the optimizer, with its variables already built.
        keep: number of most recent checkpoints kept (>= 1).

    Raises:
        HvdtrainError: if the directory cannot be created or written.
    """

    def __init__(self, directory: str, model, optimizer, keep: int = 3):
        self.directory = directory
        self.model = model
        self.keep = keep
        # Keras 3 keeps layers held in a list or dict of a subclassed model out of TensorFlow's
        # object graph: the model's variables, listed too, are all saved.
        keras3 = {"model_variables": list(model.variables)} if kerases.version_of(model) == 3 else {}
        self._checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, **keras3)
        _refuse_a_file(directory)
        try:
            os.makedirs(directory, exist_ok=True)
            probe = os.path.join(directory, f".write-test-{os.getpid()}")
            with open(probe, "w") as f:
                f.write("ok")
            os.remove(probe)
        except OSError as e:
            raise HvdtrainError(f"checkpoint directory {directory} is not writable: {e.strerror or e}") from None
        self._finish_interrupted_replacements()

    def _finish_interrupted_replacements(self) -> None:
        """Put back a checkpoint whose re-save (same tag, :meth:`save`) was interrupted between its
        two renames, leaving only ``ckpt-N.old-<pid>``; drop such a copy once ``ckpt-N`` is back."""
        for name in os.listdir(self.directory):
            base, old_marker, _ = name.partition(".old-")
            if not old_marker or not _NAME.match(base):
                continue
            old, final = os.path.join(self.directory, name), os.path.join(self.directory, base)
            if os.path.isfile(os.path.join(final, "meta.json")):
                shutil.rmtree(old, ignore_errors=True)
            elif os.path.isfile(os.path.join(old, "meta.json")):
                try:
                    shutil.rmtree(final, ignore_errors=True)
                    os.rename(old, final)
                except OSError as e:
                    raise HvdtrainError(f"cannot restore interrupted checkpoint {old} as {final}: "
                                        f"{e.strerror or e}") from None

    # ---- discovery ------------------------------------------------------------------------
    def completed(self) -> list:
        """Complete checkpoints as ``[(epoch_tag, path), ...]``, oldest first."""
        return completed_checkpoints(self.directory)

    def latest(self) -> Optional[str]:
        """Path of the newest complete checkpoint, or None."""
        done = self.completed()
        return done[-1][1] if done else None

    # ---- save -------------------------------------------------------------------------------
    def save(self, tag: int, meta: dict) -> str:
        """Write checkpoint ``ckpt-<tag>`` atomically and prune to the newest ``keep``.

        Args:
            tag: monotonically increasing number (hvdtrain uses the global step).
            meta: JSON-serialisable metadata (epoch, step...); the model's variable signature
                and a format version are added.

        Returns:
            The checkpoint's path.
        """
        final = os.path.join(self.directory, f"ckpt-{tag:06d}")
        tmp = os.path.join(self.directory, f".tmp-ckpt-{tag:06d}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        self._checkpoint.write(os.path.join(tmp, "state"))
        meta = {**meta, "format_version": FORMAT_VERSION, "variables": variable_signature(self.model)}
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        for name in os.listdir(tmp):
            with open(os.path.join(tmp, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(tmp)
        if os.path.exists(final):  # re-saving the same tag (after a resume): keep the old until replaced
            old = final + f".old-{os.getpid()}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        fsync_dir(self.directory)
        self._prune()
        return final

    def _prune(self) -> None:
        for _, path in self.completed()[:-self.keep]:
            shutil.rmtree(path, ignore_errors=True)
        for name in os.listdir(self.directory):  # leftovers of interrupted saves
            if name.startswith(".tmp-ckpt-") and not name.endswith(f"-{os.getpid()}"):
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    # ---- restore ---------------------------------------------------------------------------
    def restore_latest(self) -> tuple:
        """For ``--resume``: load the newest complete checkpoint; return ``(path, meta)``.

        Raises:
            HvdtrainError: if there is none, or as :meth:`restore`; for a damaged newest checkpoint
                the message also names the one before it and how to resume from that.
        """
        done = self.completed()
        if not done:
            raise HvdtrainError(f"--resume: no checkpoint in {self.directory}")
        latest = done[-1][1]
        try:
            return latest, self.restore(latest)
        except DamagedCheckpoint as e:  # not for another model's checkpoint: the older one would be too
            if len(done) < 2:
                raise
            older = os.path.basename(done[-2][1])
            raise HvdtrainError(f"{e}; {older} before it is still there: move {os.path.basename(latest)} out of "
                                f"{self.directory} to resume from {older}") from None

    def restore(self, path: str) -> dict:
        """Load checkpoint ``path`` into the model and optimizer; return its metadata.

        Raises:
            HvdtrainError: if the metadata is unreadable, the checkpoint belongs to a model with
                other variables, or the tensors cannot be read (corrupt or truncated files).
        """
        try:
            with open(os.path.join(path, "meta.json")) as f:
                meta = json.load(f)
        except (OSError, ValueError) as e:
            raise DamagedCheckpoint(f"checkpoint {path} is unreadable: {e}") from None
        if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
            raise HvdtrainError(f"checkpoint {path}: unknown format (meta.json format_version "
                                f"{meta.get('format_version') if isinstance(meta, dict) else None!r})")
        theirs, ours = meta.get("variables"), variable_signature(self.model)
        if theirs != ours:
            raise HvdtrainError(
                f"checkpoint {path} was written by another model (model {meta.get('model')!r}, "
                f"{len(theirs or [])} variables) than this run's ({self.model.name!r}, {len(ours)} variables)")
        try:
            self._checkpoint.read(os.path.join(path, "state")).assert_existing_objects_matched()
        except Exception as e:  # noqa: BLE001 -- the reader raises OpError, IndexError, ValueError... on damage
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DamagedCheckpoint(f"checkpoint {path} is corrupt or incompatible: {damaged_file(path)}"
                                    f"{first_line}") from None
        return meta
