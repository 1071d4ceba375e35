"""What a finished run leaves besides its checkpoints (rank 0): ``model.keras`` and ``curves.png``,
and the line that names them."""
from __future__ import annotations

import os
import sys
from typing import Optional

from hvdtrain.callbacks import Callback, logged_epochs
from hvdtrain.console import say
from hvdtrain.files import fsync_dir

MODEL_FILE = "model.keras"
WEIGHTS_FILE = "model.weights.h5"  # a model Keras cannot save whole
CURVES_FILE = "curves.png"


FIRST = (MODEL_FILE, WEIGHTS_FILE, "metrics.jsonl", CURVES_FILE)  # what a finished run is looked at for


def run_folder_line(run_dir: str) -> str:
    """The last line of a finished run: its folder and what is in it, the trained model first
    (``hvdtrain: done: runs/x holds model.keras, metrics.jsonl, curves.png, checkpoints/, ...``)."""
    names = [name + ("/" if os.path.isdir(os.path.join(run_dir, name)) else "") for name in os.listdir(run_dir)
             if not name.startswith(".")]
    names.sort(key=lambda name: (FIRST.index(name) if name in FIRST else len(FIRST), name))
    return f"hvdtrain: done: {run_dir} holds {', '.join(names)}"


def save_trained_model(model, run_dir: str) -> Optional[str]:
    """Write ``model`` (architecture and weights; it holds no optimizer) to ``<run_dir>/model.keras``, by a
    rename, so that the file is whole or absent. It loads with :func:`load_model`.

    A model Keras cannot save (a custom layer without ``get_config``, say) is a warning, not an
    error: the trained weights are in the checkpoints already.

    Returns:
        The file's path, or None if it could not be written.
    """
    path = os.path.join(run_dir, MODEL_FILE)
    tmp = os.path.join(run_dir, "model.tmp.keras")  # Keras picks its format by the suffix
    try:
        model.save(tmp)  # hvdtrain never compiles the model: no optimizer in the file
        os.replace(tmp, path)
        fsync_dir(run_dir)
    except Exception as e:  # noqa: BLE001 -- reported: the run itself succeeded
        if os.path.exists(tmp):
            try:
                os.remove(tmp)
            except OSError:
                pass
        weights = save_trained_weights(model, run_dir)
        say(f"hvdtrain: warning: could not save the trained model to {path} ({type(e).__name__}: "
            f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); its weights are in "
            + (f"{weights} (model.load_weights) and " if weights else "") + "the checkpoints", sys.stderr)
        return None
    return path


def save_trained_weights(model, run_dir: str) -> Optional[str]:
    """``model``'s weights to ``<run_dir>/model.weights.h5`` by a rename (a model Keras cannot save
    whole: a subclassed one without ``get_config``); its path, or None if that fails too."""
    path = os.path.join(run_dir, WEIGHTS_FILE)
    tmp = os.path.join(run_dir, "model.tmp.weights.h5")  # Keras asks for the suffix
    try:
        model.save_weights(tmp)
        os.replace(tmp, path)
        fsync_dir(run_dir)
        return path
    except Exception:  # noqa: BLE001 -- the warning names what is left: the checkpoints
        if os.path.exists(tmp):
            os.remove(tmp)
        return None


class Curves(Callback):
    """Draws ``<log_dir>/curves.png`` after every epoch: the loss and each metric per epoch, train
    and test, one panel each, from ``metrics.jsonl`` (so a resumed run's picture holds every epoch).
    Drawn on matplotlib's Agg canvas (not pyplot, which would change a notebook's backend), written
    by a rename; a failure to draw is one warning, and training goes on."""

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self._failed = False

    def on_epoch_end(self, epoch, metrics):
        import json

        if self._failed:
            return
        records = [json.loads(line) for _, line in logged_epochs(os.path.join(self.log_dir, "metrics.jsonl"))]
        try:
            if records:
                draw_curves(records, os.path.join(self.log_dir, CURVES_FILE))
        except Exception as e:  # noqa: BLE001 -- a picture is not worth a run: said once, then no more tries
            self._failed = True
            say(f"hvdtrain: warning: cannot draw {CURVES_FILE} ({type(e).__name__}: {e}); training goes on",
                sys.stderr)


def draw_curves(records: list, path: str) -> None:
    """Plot ``records`` (``metrics.jsonl``'s epoch objects) to the PNG ``path`` (see :class:`Curves`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # no pyplot: the caller's backend stays
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    # Each metric once, train and test in one panel (a run without a test set: the train ones).
    names = list(dict.fromkeys(key.split("_", 1)[1] for key in records[-1]
                               if key.startswith(("train_", "test_")) and key != "train_examples"))
    epochs = [r["epoch"] for r in records]
    fig = Figure(figsize=(4.5 * len(names), 3.5))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(names), squeeze=False)
    for ax, name in zip(axes[0], names):
        for split in ("train", "test"):
            values = [r.get(f"{split}_{name}") for r in records]
            if any(v is not None for v in values):
                ax.plot(epochs, values, marker="o", label=split)
        ax.set_title(name)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=80)
    os.replace(tmp, path)


def load_model(path: str, keras: int = 0):
    """Keras' ``models.load_model(path)`` with hvdtrain's layers registered first, by the Keras
    that saved the file (2 or 3, read from its ``metadata.json``; ``keras`` to choose): a run's
    ``model.keras`` names ``SyncBatchNormalization``, which Keras 2 would otherwise take for its
    own ``experimental.SyncBatchNormalization``.

    Raises:
        OSError, ValueError: as Keras' ``load_model``, for a missing or unreadable file.
    """
    from hvdtrain import kerases
    from hvdtrain.model.sync_bn import layer_class
    from hvdtrain.model.zoo import dropout_class
    from hvdtrain.optim import schedule_class

    module = kerases.module(keras or saved_by(path))
    ours = [make(module) for make in (layer_class, dropout_class, schedule_class)]
    return module.models.load_model(path, custom_objects={cls.__name__: cls for cls in ours})


def saved_by(path: str) -> int:
    """The Keras (2 or 3) that wrote the ``.keras`` file ``path``; 2 where it does not say."""
    import json
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            version = json.loads(archive.read("metadata.json")).get("keras_version", "2")
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        return 2  # Keras' own load_model then says what is wrong with the file
    return 3 if str(version).split(".")[0] == "3" else 2
