"""Stock Keras callbacks (Keras 2 or 3) in :func:`hvdtrain.fit`: one hvdtrain callback that drives them.

Keras callbacks see what ``model.fit`` would show them -- ``loss``, ``accuracy``, ``val_loss``,
``val_accuracy``..., here global (allreduced over ranks, exact) -- so ``EarlyStopping`` and
``ReduceLROnPlateau`` decide alike on every rank. Callbacks that write files or print progress
(``ModelCheckpoint``, ``CSVLogger``, ``ProgbarLogger``, ``RemoteMonitor``) run on rank 0 only; the
others run on every rank, where they change the model, its optimizer or the run alike (a
``stop_training`` set on any rank stops every rank after the same epoch: :class:`hvdtrain.trainer.Trainer`
agrees on it), and print from rank 0 only (``verbose`` is 0 elsewhere). Your own Keras callbacks
run on every rank, as in Horovod's Keras API.
"""
from __future__ import annotations

from typing import List, Sequence

from hvdtrain import kerases
from hvdtrain.callbacks import Callback
from hvdtrain.errors import HvdtrainError

# Callbacks whose side effects are files or progress lines: rank 0's alone (subclasses too).
CHIEF_ONLY = ("ModelCheckpoint", "CSVLogger", "ProgbarLogger", "RemoteMonitor")
# Callbacks whose job hvdtrain does itself, differently: refused, with what to use instead.
REFUSED = {
    "BackupAndRestore": "hvdtrain checkpoints every epoch (--checkpoint-every for steps) and continues exactly "
                        "with resume=True (--resume)",
    "TensorBoard": "hvdtrain writes TensorBoard logs itself, to <log-dir>/tensorboard (tensorboard --logdir <log-dir>)",
}
# Callbacks that set the optimizer's learning rate, which must then be a number (a variable), not a schedule.
SETS_LR = ("ReduceLROnPlateau", "LearningRateScheduler")
# hvdtrain's metrics that improve upwards (its losses improve downwards): what a callback monitoring
# them with mode="auto" needs told under Keras 3, which reads it from a compiled model's metrics.
RISING = ("accuracy", "top5", "mean_iou")


def _keras_of(obj):
    """The Keras package (2 or 3) of a Keras object, or None."""
    version = kerases.version_of(obj)
    return kerases.module(version) if version else None


def _kind(callback, names) -> str:
    """The name among ``names`` of the Keras callback class ``callback`` is (or subclasses), or ""."""
    keras = _keras_of(callback)
    for name in names if keras is not None else ():
        cls = getattr(keras.callbacks, name, None)
        if cls is not None and isinstance(callback, cls):
            return name
    return ""


def is_keras_callback(callback) -> bool:
    """Whether ``callback`` is a Keras (2 or 3) ``callbacks.Callback``, rather than an hvdtrain one."""
    keras = _keras_of(callback)
    return keras is not None and isinstance(callback, keras.callbacks.Callback)


# Rank-local figures (each rank times itself): left out, so that every callback decides alike.
RANK_LOCAL = ("images_per_sec", "epoch_time_s")


def keras_logs(metrics: dict) -> dict:
    """hvdtrain's global epoch metrics under Keras' names: ``train_loss`` -> ``loss``,
    ``test_accuracy`` -> ``val_accuracy``, ``lr`` as ``lr`` and ``learning_rate``; the rest as they
    are, but for the rank-local timings."""
    logs = {}
    for key, value in metrics.items():
        if key in RANK_LOCAL:
            continue
        if key.startswith("train_") and key != "train_examples":
            logs[key[len("train_"):]] = value
        elif key.startswith("test_"):
            logs["val_" + key[len("test_"):]] = value
        else:
            logs[key] = value
    if "lr" in logs:
        logs["learning_rate"] = logs["lr"]
    return logs


class _ModelView:
    """The model as Keras callbacks reach it (``self.model``): the trained model's methods and
    weights, the run's optimizer as ``optimizer``, and ``stop_training``. A view, so that the
    optimizer (Horovod's wrapper) is not made part of the model, whose saved file must not hold it;
    it is no Keras ``Model`` itself (a callback that checks ``isinstance`` refuses it)."""

    def __init__(self, model, optimizer):
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "optimizer", optimizer)
        object.__setattr__(self, "stop_training", False)

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __setattr__(self, name, value):
        if name in ("optimizer", "stop_training"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._model, name, value)


class KerasCallbacks(Callback):
    """Runs Keras callbacks at hvdtrain's hooks (see the module's docstring).

    Args:
        callbacks: Keras ``callbacks.Callback`` objects of the model's Keras, in the order to call them.
        model: the model being trained.
        optimizer: the run's (Horovod-wrapped) optimizer.
        is_chief: whether this is rank 0.
        epochs: the run's total epochs (Keras' ``params``).
        steps: steps per epoch (Keras' ``params``).

    Raises:
        HvdtrainError: for ``BackupAndRestore`` and ``TensorBoard`` (hvdtrain does their job), and
            for ``ReduceLROnPlateau`` or ``LearningRateScheduler`` when the optimizer's learning
            rate is a schedule (hvdtrain's warmup schedule, or the user's), which they cannot set.
    """

    chief_only = False

    def __init__(self, callbacks: Sequence, model, optimizer, is_chief: bool, epochs: int, steps: int):
        for cb in callbacks:
            name = _kind(cb, REFUSED)
            if name:
                raise HvdtrainError(f"hvdtrain.fit(callbacks=...): Keras' callbacks.{name} is not supported: {REFUSED[name]}")
            name = _kind(cb, SETS_LR)
            keras = _keras_of(optimizer)
            if name and keras is not None and isinstance(getattr(optimizer, "_learning_rate", None),
                                                         keras.optimizers.schedules.LearningRateSchedule):
                raise HvdtrainError(
                    f"hvdtrain.fit(callbacks=...): {name} sets the optimizer's learning rate, but the optimizer's rate "
                    f"follows a LearningRateSchedule (hvdtrain's warmup schedule, or your own): pass your own "
                    f"optimizer with a number as its learning rate, e.g. optimizer=keras.optimizers.SGD(0.1)")
        self.callbacks: List = [cb for cb in callbacks if is_chief or not _kind(cb, CHIEF_ONLY)]
        for cb in self.callbacks:
            _resolve_auto_mode(cb)
        self.view = _ModelView(model, optimizer)
        for cb in self.callbacks:
            if not is_chief and hasattr(cb, "verbose"):
                cb.verbose = 0  # each rank decides alike: rank 0 says it
            cb.set_model(self.view)
            cb.set_params({"epochs": epochs, "steps": steps, "verbose": 1 if is_chief else 0})
        self._logs: dict = {}
        self._began = False

    @property
    def stop_training(self) -> bool:
        """Whether a Keras callback asked to stop (``model.stop_training``), on this rank."""
        return bool(self.view.stop_training)

    def on_train_begin(self, start_epoch, epochs):
        self._began = True
        for cb in self.callbacks:
            cb.on_train_begin({})

    def on_epoch_begin(self, epoch, steps, first_step=0):
        for cb in self.callbacks:
            cb.on_epoch_begin(epoch, {})

    def on_step_end(self, epoch, step, running):
        if running:  # the global running metrics, where they were reduced; else the last ones
            self._logs = keras_logs({k: v for k, v in running.items() if k != "count"})
        for cb in self.callbacks:
            cb.on_train_batch_end(step, dict(self._logs))

    def on_epoch_end(self, epoch, metrics):
        logs = keras_logs(metrics)
        for cb in self.callbacks:
            cb.on_epoch_end(epoch, logs)

    def on_train_end(self):
        if self._began:
            self._began = False
            for cb in self.callbacks:  # EarlyStopping restores its best weights, CSVLogger closes its file
                cb.on_train_end(dict(self._logs))

    def close(self):
        self.on_train_end()  # a run that failed: files closed all the same


def _resolve_auto_mode(callback) -> None:
    """``mode="min"``/``"max"`` for a Keras 3 callback that monitors hvdtrain's loss or a metric of
    :data:`RISING` with ``mode="auto"``: Keras 3 looks the direction up in the compiled model's
    metrics, and hvdtrain's model is not compiled. Other monitored names stay as Keras decides."""
    monitor, mode = getattr(callback, "monitor", None), getattr(callback, "mode", None)
    if kerases.version_of(callback) != 3 or not isinstance(monitor, str) or mode != "auto":
        return
    name = monitor[len("val_"):] if monitor.startswith("val_") else monitor
    if name == "loss" or name in RISING:
        callback.mode = "min" if name == "loss" else "max"
