"""hvdtrain: data-parallel TensorFlow 2 training on Horovod.

Start one process per rank: ``horovodrun -np 2 --gloo python -m hvdtrain``. Importing the package
is cheap; TensorFlow is loaded when a TensorFlow-backed name is first used.
"""
__version__ = "0.1.0"

__all__ = ["SyncBatchNormalization", "HvdtrainError", "__version__"]

from hvdtrain.errors import HvdtrainError


def __getattr__(name):
    if name == "SyncBatchNormalization":
        from hvdtrain.sync_bn import SyncBatchNormalization

        return SyncBatchNormalization
    raise AttributeError(f"module 'hvdtrain' has no attribute {name!r}")
