"""Bit-identical runs at any world size (``--deterministic``)."""
from __future__ import annotations

import os
import sys

from hvdtrain.errors import EveryRankError
from hvdtrain.runtime.launcher import launcher_world_size


def make_deterministic() -> None:
    """Make every collective and every TensorFlow op of this process deterministic; call before
    ``hvd.init()``.

    Horovod's tensor fusion packs the tensors ready in one cycle into one buffer: which ones
    depends on timing, and so does where each element falls in the ring's chunks, so at 3+ ranks
    the order of its sum changes from run to run (horovod#1548; a sum of two is the same either
    way, so at 1 or 2 ranks fusion stays on). Each tensor reduced alone is reduced the same way
    every time: ``HOROVOD_FUSION_THRESHOLD=0``. TensorFlow's own ops (cuDNN's on a GPU, say) get
    deterministic kernels (``tf.config.experimental.enable_op_determinism``).

    Raises:
        EveryRankError: if ``HOROVOD_FUSION_THRESHOLD`` asks for fusion at 3+ ranks, or Horovod
            already started with fusion on (an earlier :func:`hvdtrain.init_distributed` call).
    """
    import tensorflow as tf

    size = launcher_world_size()
    if size is None or size > 2:
        started = sys.modules.get("horovod.tensorflow")
        if started is not None and started.is_initialized() and os.environ.get("HOROVOD_FUSION_THRESHOLD") != "0":
            raise EveryRankError("--deterministic must be chosen before Horovod starts (it reads HOROVOD_FUSION_THRESHOLD "
                                 "once): call hvdtrain.init_distributed(deterministic=True) first, or export "
                                 "HOROVOD_FUSION_THRESHOLD=0")
        if os.environ.get("HOROVOD_FUSION_THRESHOLD", "0") != "0":
            raise EveryRankError(f"--deterministic turns Horovod's tensor fusion off, but HOROVOD_FUSION_THRESHOLD="
                                 f"{os.environ['HOROVOD_FUSION_THRESHOLD']} asks for it: unset it")
        os.environ["HOROVOD_FUSION_THRESHOLD"] = "0"
    tf.config.experimental.enable_op_determinism()
