"""Which devices TensorFlow's runtime holds, where a user's script started it before hvdtrain could pin them."""
from __future__ import annotations

from typing import Optional

from hvdtrain.errors import HvdtrainError


def runtime_started() -> bool:
    """Whether TensorFlow's runtime has started in this process (an op ran or a variable was
    made): from then on its visible devices and thread pools are fixed."""
    from tensorflow.python.eager import context  # no public API tells; stable from TF 2.4 to 2.21

    return context.context()._context_handle is not None


def check_started_devices(wanted) -> Optional[HvdtrainError]:
    """With the runtime started before :func:`init_distributed`: None if the GPUs it holds are
    exactly ``wanted`` (this rank's one GPU, or none on a CPU rank), else the error saying why
    that is the "every rank holds every GPU" pitfall and what to do."""
    import tensorflow as tf

    held = tf.config.get_visible_devices("GPU")
    if [gpu.name for gpu in held] == [gpu.name for gpu in wanted] or (len(held) == 1 and len(wanted) == 1):
        return None
    return HvdtrainError(
        f"TensorFlow's runtime started before hvdtrain could pin this rank to its device (an op ran, or a variable "
        f"was made -- a Keras optimizer, layer or tensor -- before hvdtrain.fit), so this rank holds "
        f"{len(held)} GPU(s) where it should hold {len(wanted)}: every rank would reserve memory on every GPU. "
        f"Call hvdtrain.init_distributed() at the top of your script, before any other TensorFlow work")
