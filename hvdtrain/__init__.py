"""hvdtrain: data-parallel TensorFlow 2 training on Horovod.

Start one process per rank: ``horovodrun -np 2 --gloo python -m hvdtrain``. Importing the package
is cheap; TensorFlow is loaded when a TensorFlow-backed name is first used.
"""
import importlib
import importlib.util
import os

# Before TensorFlow is imported, which reads both once:
# * tf.keras stays Keras 2 (the tf_keras package) on TensorFlow >= 2.16, so that code written for
#   tf.keras keeps the Keras it was written for; `import keras` is Keras 3. hvdtrain trains either
#   (hvdtrain.kerases): a process trains the Keras of the objects it is given.
# * TensorFlow's INFO banners (oneDNN, cpu_feature_guard), printed by every rank, hide hvdtrain's lines.
if importlib.util.find_spec("tf_keras") is not None:
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

__version__ = "0.1.0"

__all__ = ["fit", "FitResult", "Config", "Callback", "SyncBatchNormalization", "convert_sync_batchnorm", "load_model",
           "Trainer", "ShardPlan", "init_distributed", "broadcast_state", "HvdtrainError", "__version__"]

from hvdtrain.errors import HvdtrainError  # noqa: E402

# name -> module: loaded on first use (hvdtrain.api and the model import TensorFlow, or YAML).
_LAZY = {"fit": "hvdtrain.api", "FitResult": "hvdtrain.api", "Config": "hvdtrain.config",
         "Callback": "hvdtrain.callbacks", "SyncBatchNormalization": "hvdtrain.model.sync_bn",
         "convert_sync_batchnorm": "hvdtrain.model.convert", "load_model": "hvdtrain.outputs",
         # Your own loop: the distributed context, each rank's shard of each global batch, the trainer.
         "init_distributed": "hvdtrain.runtime.dist", "ShardPlan": "hvdtrain.data.sharding",
         "broadcast_state": "hvdtrain.recipe_steps", "Trainer": "hvdtrain.trainer"}


def __getattr__(name):
    if name in ("keras2", "keras3"):  # each Keras's layers and schedule (imports that Keras)
        return importlib.import_module(f"hvdtrain.{name}")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hvdtrain' has no attribute {name!r}")
