"""Bit-identical runs at any world size: what hvdtrain's collectives promise, and ``--deterministic``."""
from __future__ import annotations

import os
import re
import sys

from hvdtrain.errors import EveryRankError


def _horovod_flag_on(value: str) -> bool:
    """Whether Horovod reads ``value`` as on: its leading integer above 0 (``strtol``, operations.cc)."""
    match = re.match(r"\s*[+-]?\d+", value)
    return bool(match) and int(match.group()) > 0


def make_deterministic() -> None:
    """Give this process TensorFlow's deterministic kernels too; call before ``hvd.init()``.

    hvdtrain's collectives repeat without it: each gradient bucket and each BatchNorm's statistics
    is a group that Horovod fuses alone (``HOROVOD_DISABLE_GROUP_FUSION=1``, :mod:`hvdtrain.exchange`),
    so every step reduces the same buffers in the same order. What can still change from run to run
    is a TensorFlow kernel that sums in parallel in any order (cuDNN's on a GPU, say):
    ``tf.config.experimental.enable_op_determinism`` picks the deterministic ones.

    Raises:
        EveryRankError: if ``HOROVOD_DISABLE_GROUP_FUSION`` asks Horovod to fuse groups by timing,
            if ``HOROVOD_AUTOTUNE`` is on (it changes the fusion threshold, and so the buffers, as it
            searches), or if Horovod already started without the first (an earlier ``hvd.init()``).
    """
    import tensorflow as tf

    if _horovod_flag_on(os.environ.get("HOROVOD_AUTOTUNE", "")):
        raise EveryRankError(f"--deterministic needs the same fused buffers every step, but "
                             f"HOROVOD_AUTOTUNE={os.environ['HOROVOD_AUTOTUNE']} changes Horovod's fusion "
                             f"threshold as it tunes: unset it")
    setting = os.environ.get("HOROVOD_DISABLE_GROUP_FUSION")
    if setting not in (None, "1"):
        raise EveryRankError(f"--deterministic keeps each gradient bucket in a fused buffer of its own, but "
                             f"HOROVOD_DISABLE_GROUP_FUSION={setting} lets Horovod fuse them by timing: unset it")
    started = sys.modules.get("horovod.tensorflow")
    if started is not None and started.is_initialized() and setting != "1":
        raise EveryRankError("--deterministic must be chosen before Horovod starts (it reads "
                             "HOROVOD_DISABLE_GROUP_FUSION once): call hvdtrain.init_distributed(deterministic=True) "
                             "first, or export HOROVOD_DISABLE_GROUP_FUSION=1")
    os.environ["HOROVOD_DISABLE_GROUP_FUSION"] = "1"
    tf.config.experimental.enable_op_determinism()
