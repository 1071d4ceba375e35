"""Which Keras a process trains: Keras 2 or Keras 3, one per process.

TensorFlow <= 2.15 ships Keras 2 as ``tf.keras``. From TensorFlow 2.16 on, ``import keras`` (and
``tf.keras`` by default) is Keras 3, and Keras 2 is the ``tf_keras`` package. ``import hvdtrain``
sets ``TF_USE_LEGACY_KERAS=1`` where ``tf_keras`` is installed, so that code written for
``tf.keras`` keeps the Keras 2 it was written for, while ``import keras`` stays Keras 3: a user
picks a Keras by the objects they build, with no setting.

hvdtrain trains either. The user's objects (model, optimizer, loss, callbacks) decide; the
built-in models use ``--keras`` (``Config.model.keras``), whose default 0 is the Keras
TensorFlow gives by default: 3 where Keras 3 is installed (TensorFlow >= 2.16), else 2. Keras 3
must run on its TensorFlow backend: Horovod's collectives are TensorFlow ops.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import random
import sys
from types import ModuleType
from typing import Iterable, Optional, Tuple

from hvdtrain.errors import HvdtrainError

@functools.lru_cache(maxsize=None)
def _installed_keras_major() -> int:
    """The major version of the installed ``keras`` package (0 where there is none), without importing it."""
    import importlib.metadata

    try:
        return int(importlib.metadata.version("keras").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return 0


def keras3_installed() -> bool:
    """Whether ``import keras`` is Keras 3 here (TensorFlow >= 2.16)."""
    return _installed_keras_major() >= 3


def default_version() -> int:
    """The Keras TensorFlow gives by default here: 3 where Keras 3 is installed, else 2."""
    return 3 if keras3_installed() else 2


def keras2() -> ModuleType:
    """Keras 2: ``tf.keras`` where it is Keras 2 (TensorFlow <= 2.15, or ``TF_USE_LEGACY_KERAS=1``
    as ``import hvdtrain`` sets it), else the ``tf_keras`` package.

    Raises:
        HvdtrainError: where Keras 2 is not installed.
    """
    import tensorflow as tf

    if version_of(tf.keras.layers.Layer) == 2:
        return tf.keras
    if importlib.util.find_spec("tf_keras") is None:
        raise HvdtrainError(f"Keras 2 on TensorFlow {tf.__version__} is the tf-keras package: pip install "
                            f"tf-keras=={tf.__version__} (scripts/setup.sh does), or train Keras 3 (--keras 3)")
    import tf_keras

    return tf_keras


def keras3() -> ModuleType:
    """Keras 3 (``import keras``) on its TensorFlow backend.

    Raises:
        HvdtrainError: where Keras 3 is not installed (TensorFlow <= 2.15), or runs on another
            backend (``KERAS_BACKEND``).
    """
    if not keras3_installed():
        import tensorflow as tf

        raise HvdtrainError(f"Keras 3 needs TensorFlow >= 2.16 (this is TensorFlow {tf.__version__}, whose Keras is "
                            f"Keras 2): train Keras 2 (--keras 2), or use the default stack (scripts/setup.sh)")
    fix = "hvdtrain averages gradients with Horovod's TensorFlow ops: set KERAS_BACKEND=tensorflow"
    try:
        import keras
    except ImportError as e:  # the backend's own package missing (KERAS_BACKEND=jax without jax...)
        raise HvdtrainError(f"Keras 3 cannot start its {os.environ.get('KERAS_BACKEND', 'configured')!r} backend "
                            f"({type(e).__name__}: {e}); {fix}") from e
    if keras.backend.backend() != "tensorflow":
        raise HvdtrainError(f"Keras 3 runs on its {keras.backend.backend()!r} backend here (KERAS_BACKEND="
                            f"{os.environ.get('KERAS_BACKEND', '')!r} or ~/.keras/keras.json); {fix}")
    return keras


def module(version: int) -> ModuleType:
    """The Keras package of ``version`` (2 or 3) (:func:`keras2`, :func:`keras3`)."""
    return keras3() if version == 3 else keras2()


@functools.lru_cache(maxsize=None)
def class_for(base: type, keras: ModuleType, keras_base: str) -> type:
    """``base`` (hvdtrain's class, written once for both Kerases) made a subclass of ``keras``'
    ``keras_base`` (e.g. ``"layers.Layer"``), registered for deserialization as
    ``hvdtrain>Name`` (``Name`` is ``base``'s name without ``Base``); made once per Keras.

    Its ``__module__`` is ``hvdtrain.keras3`` for Keras 3 (where users import it from), else
    ``base``'s own module; ``base`` reads its Keras as ``self._keras``.
    """
    version = version_of(keras.layers.Layer)
    parent = functools.reduce(getattr, keras_base.split("."), keras)
    name = base.__name__[:-len("Base")] if base.__name__.endswith("Base") else base.__name__
    cls = type(name, (base, parent), {"__doc__": base.__doc__, "_keras": keras,
                                      "__module__": "hvdtrain.keras3" if version == 3 else base.__module__})
    register = keras.saving.register_keras_serializable if version == 3 else keras.utils.register_keras_serializable
    return register(package="hvdtrain")(cls)


def version_of(obj) -> Optional[int]:
    """2 or 3 for a Keras object or class (model, layer, optimizer, loss, callback, schedule), by
    the package its class comes from; None for anything else."""
    for cls in (obj if isinstance(obj, type) else type(obj)).__mro__:
        top = cls.__module__.split(".")[0]
        if top == "tf_keras" or cls.__module__.startswith("tensorflow.python.keras"):
            return 2
        if top == "keras":
            return 3 if keras3_installed() else 2
    return None


def _describe(obj) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _parts(what: str, obj) -> Iterable[Tuple[str, object]]:
    """``obj`` and, for a model or layer, the layers it holds and the Keras objects in their
    attributes (a Keras 2 layer set on a Keras 3 model, which Keras 3 does not track)."""
    yield what, obj
    layers = list(getattr(obj, "_flatten_layers", lambda **_: ())(include_self=False, recursive=True))
    for layer in layers:
        yield f"{what}'s layer {getattr(layer, 'name', '?')!r}", layer
    for holder in [obj, *layers]:
        for name, value in (vars(holder).items() if hasattr(holder, "__dict__") else ()):
            if not name.startswith("_") and version_of(value) is not None:
                yield f"{what}'s {'' if holder is obj else repr(getattr(holder, 'name', '?')) + ' '}attribute " \
                      f"{name!r}", value


def choose(version: int = 0, **objects) -> int:
    """The Keras this process trains: the one of ``objects`` (the user's model, optimizer, loss,
    callbacks, ...; None for not given), else ``version``, else :func:`default_version`.

    Args:
        version: ``--keras``: 2, 3, or 0 (no preference).
        objects: name -> object (or a list of them, such as callbacks), for messages.

    Returns:
        2 or 3 (its package imported and checked: :func:`module`).

    Raises:
        HvdtrainError: for objects of both Kerases (naming one of each), objects of another Keras
            than ``version``, or a Keras that is not usable here.
    """
    found = {}
    for name, value in objects.items():
        for i, obj in enumerate(value if isinstance(value, (list, tuple)) else [value]):
            label = f"{name}[{i}]" if isinstance(value, (list, tuple)) else name
            for what, part in ([] if obj is None else _parts(label, obj)):
                v = version_of(part)
                if v is not None:
                    found.setdefault(v, (what, part))
    fix = ("build every object with one Keras: `import keras` (Keras 3), or tf.keras / `import tf_keras` (Keras 2); "
           "a process trains one")
    if len(found) > 1:
        (w2, o2), (w3, o3) = found[2], found[3]
        raise HvdtrainError(f"the {w3} ({_describe(o3)}) is Keras 3 but the {w2} ({_describe(o2)}) is Keras 2: {fix}")
    if found and version and version not in found:
        (what, obj), = found.values()
        raise HvdtrainError(f"--keras {version}, but the {what} ({_describe(obj)}) is Keras {next(iter(found))}: "
                            f"give --keras {next(iter(found))} or leave it out, or {fix[0].lower()}{fix[1:]}")
    chosen = next(iter(found)) if found else (version or default_version())
    module(chosen)
    return chosen


def set_random_seed(seed: int) -> None:
    """Seed Python's, NumPy's and TensorFlow's generators (what each Keras' ``set_random_seed``
    seeds), and Keras 3's own where it is imported. Keras 3 imported later (by a model function)
    draws its initializers' seeds from Python's generator, seeded here."""
    import numpy as np
    import tensorflow as tf

    random.seed(seed)
    np.random.seed(seed)
    tf.random.set_seed(seed)
    if "keras" in sys.modules and keras3_installed():
        sys.modules["keras"].utils.set_random_seed(seed)


def is_floating(variable) -> bool:
    """Whether a variable (TensorFlow's, or Keras 3's, whose ``dtype`` is a string) holds floats."""
    import tensorflow as tf

    return tf.as_dtype(variable.dtype).is_floating
