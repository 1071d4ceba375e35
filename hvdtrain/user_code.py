"""Importing a user's ``package.module:function`` (a model, a data pipeline)."""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Callable

from hvdtrain.errors import HvdtrainError


def import_function(spec: str, flag: str) -> Callable:
    """The function ``spec`` (``"package.module:function"``) names, given by ``flag``.

    Raises:
        HvdtrainError: naming ``flag`` and ``spec``, for a malformed spec, a module that cannot be
            imported (or fails while importing), or a name that is not a callable in it.
    """
    module_name, _, fn_name = spec.partition(":")
    if not module_name or not fn_name:
        raise HvdtrainError(f"{flag} {spec!r}: expected 'package.module:function'")
    try:
        module = _running_script(module_name) or importlib.import_module(module_name)
    except (Exception, SystemExit) as e:  # noqa: BLE001 -- not found, or the user's module fails while importing
        raise HvdtrainError(f"{flag} {spec!r}: cannot import module {module_name!r} ({type(e).__name__}: {e})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise HvdtrainError(f"{flag} {spec!r}: module {module_name!r} has no function {fn_name!r}")
    return fn


def _running_script(module_name: str):
    """The ``__main__`` module if ``module_name`` is the script being run (``python train.py``
    naming ``train:make_data``): importing it again would run the script's training a second time."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or module_name in sys.modules:
        return None
    try:
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return None
    origin = getattr(found, "origin", None)
    return main if origin and os.path.exists(origin) and os.path.samefile(origin, path) else None


def name_of(spec) -> str:
    """What a user's part is called in messages: ``spec`` itself if a string, else its ``__name__``
    (a function's), else its type's."""
    return spec if isinstance(spec, str) else getattr(spec, "__name__", type(spec).__name__)
