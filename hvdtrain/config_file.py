"""Run files: a :class:`~hvdtrain.config.Config` as YAML, read (``--config run.yaml``) and written.

A run file names the config tree's fields as the tree nests them, any subset of them; the rest
keep their defaults::

    epochs: 30
    batch_size: 64
    model: {name: resnet20}
    optim:
      base_lr: 0.1
      warmup_epochs: 5

``hvdtrain --print-config`` prints a complete one, and every run writes the one it ran with to
``<log-dir>/config.yaml``. Files are read with ``yaml.safe_load`` (no Python objects are built).
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, Dict, Optional

import yaml

from hvdtrain.config import Config
from hvdtrain.errors import HvdtrainError

_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
               Optional[str]: "a string or null"}


def leaf_types(cls=Config, prefix: str = "") -> Dict[str, Any]:
    """``{dotted key: type}`` of every setting of the config tree, e.g. ``{"optim.base_lr": float}``."""
    types = {}
    for name, hint in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(hint):
            types.update(leaf_types(hint, f"{prefix}{name}."))
        else:
            types[prefix + name] = hint
    return types


def _typed(value, hint):
    """``value`` as a setting of type ``hint`` (an int for a float, or a float written ``1e-3``, which
    YAML 1.1 reads as a string), or raise ``TypeError``."""
    if hint is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise TypeError from None
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    ok = {int: isinstance(value, int) and not isinstance(value, bool), float: isinstance(value, float),
          bool: isinstance(value, bool), str: isinstance(value, str),
          Optional[str]: value is None or isinstance(value, str)}[hint]
    if not ok:
        raise TypeError
    return value


def flatten(values: dict, source: str, prefix: str = "") -> Dict[str, Any]:
    """The nested mapping ``values`` as ``{dotted key: value}``, each key known and each value of
    its setting's type.

    Raises:
        HvdtrainError: ``"<source>: ..."`` naming an unknown key (and the nearest known one), a
            section that is not a mapping, or a value of the wrong type.
    """
    types, flat = leaf_types(), {}
    sections = {key.rsplit(".", 1)[0] + "." for key in types if "." in key}
    for name, value in values.items():
        key = f"{prefix}{name}"
        if f"{key}." in sections:
            if not isinstance(value, dict):
                raise HvdtrainError(f"{source}: {key} must be a mapping of its settings "
                                    f"({', '.join(k[len(key) + 1:] for k in types if k.startswith(key + '.'))}), "
                                    f"got {value!r}")
            flat.update(flatten(value, source, f"{key}."))
        elif key in types:
            try:
                flat[key] = _typed(value, types[key])
            except TypeError:
                raise HvdtrainError(f"{source}: {key} must be {_TYPE_NAMES[types[key]]}, got {value!r}") from None
        else:
            known = [k[len(prefix):] for k in types if k.startswith(prefix)]
            known = sorted({k.split(".")[0] for k in known})
            near = difflib.get_close_matches(str(name), known, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else f"; known keys{' of ' + prefix[:-1] if prefix else ''}: " \
                                                               f"{', '.join(known)}"
            raise HvdtrainError(f"{source}: unknown key {key!r}{hint}")
    return flat


def config_from_flat(flat: Dict[str, Any]) -> Config:
    """A :class:`Config` of the defaults with the settings ``{dotted key: value}`` of ``flat``.

    Raises:
        ConfigError: for a value out of its range (naming its flag).
        HvdtrainError: for a combination of settings that cannot run.
    """
    def build(cls, prefix):
        kwargs = {}
        for name, hint in typing.get_type_hints(cls).items():
            if dataclasses.is_dataclass(hint):
                kwargs[name] = build(hint, f"{prefix}{name}.")
            elif prefix + name in flat:
                kwargs[name] = flat[prefix + name]
        return cls(**kwargs)

    return build(Config, "")


def read_config_file(path: str) -> Dict[str, Any]:
    """The settings of the run file at ``path`` as ``{dotted key: value}`` (see :func:`flatten`).

    Raises:
        HvdtrainError: for a missing or unreadable file, invalid YAML, a top level that is not a
            mapping, an unknown key or a value of the wrong type, naming the file.
    """
    try:
        with open(path, encoding="utf-8") as f:
            values = yaml.safe_load(f)
    except OSError as e:
        raise HvdtrainError(f"cannot read config file {path}: {e.strerror or e} (--config)") from None
    except yaml.YAMLError as e:
        raise HvdtrainError(f"config file {path} is not valid YAML: {' '.join(str(e).split())}") from None
    if values is None:  # an empty file: every default
        return {}
    if not isinstance(values, dict):
        raise HvdtrainError(f"config file {path} must be a mapping of settings (epochs: 12, optim: {{...}}, ...), "
                            f"got {type(values).__name__}")
    return flatten(values, f"config file {path}")


def config_to_yaml(config: Config) -> str:
    """The whole ``config`` as a run file (YAML, in the tree's field order) that reads back to it."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False, default_flow_style=False)
