"""Checks of class labels and values: the messages that name the place of a bad one."""
from __future__ import annotations

import numpy as np

from hvdtrain.errors import HvdtrainError


def check_finite(name: str, key: str, values: np.ndarray, what: str) -> None:
    """Refuse NaN or Inf in ``values`` (float32), naming the first one's index (0-based) and value.

    Raises:
        HvdtrainError: ``"<name>: x_train contains NaN or Inf: example 17 (0-based) holds nan ..."``.
    """
    finite = np.isfinite(values)
    if finite.all():
        return
    first = np.argwhere(~finite)[0]
    at = f" at {tuple(int(i) for i in first[1:])}" if len(first) > 1 else ""
    raise HvdtrainError(f"{name}: {key} contains NaN or Inf (or values beyond float32's range, 3.4e38): {what} "
                        f"{first[0]} (0-based) holds {values[tuple(first)]}{at}")


def not_integer_labels(key: str, y: np.ndarray) -> str:
    """The rest of the message for float (or other) class labels: the fix for whole numbers, else
    the first value that is not one and its index."""
    if not np.issubdtype(y.dtype, np.floating) or y.size == 0:
        return " (targets need --loss binary_crossentropy or mse)"
    flat = y.reshape(len(y), -1) if y.ndim else y.reshape(1, -1)
    fraction = ~np.isfinite(flat) | (flat != np.round(flat))
    if not fraction.any():
        return (f" holding whole numbers: cast it to an integer dtype ({key}.astype('int64')) to use them as "
                f"class indices")
    index = int(np.argwhere(fraction.any(axis=1))[0][0])
    value = flat[index][fraction[index]][0]
    return (f", and {key}[{index}] (0-based) holds {value}, not a class index (targets need --loss "
            f"binary_crossentropy or mse)")


def _where_label(value: int, y_train: np.ndarray, y_test: np.ndarray, positions: bool) -> str:
    """Where the first label equal to ``value`` is: ``y_test[42], 0-based`` (in-memory arrays, whose
    order is the data's), else its split (a stream's labels come from a scan, not in its order)."""
    for key, split, y in (("y_train", "training", y_train), ("y_test", "test", y_test)):
        hits = np.argwhere(y.reshape(len(y), -1) == value)
        if len(hits):
            return f"{key}[{int(hits[0][0])}], 0-based" if positions else f"the {split} split"
    return "a label"


def check_labels(name: str, y_train: np.ndarray, y_test: np.ndarray, num_classes: int = 0,
                 positions: bool = False) -> int:
    """Check integer class labels and return the class count.

    Args:
        name: the dataset, for messages.
        y_train, y_test: integer labels ``(n,)`` of the splits.
        num_classes: label count; 0 infers ``max(label) + 1`` over both splits.
        positions: the arrays are in the data's order, so a message names the label's index
            (``y_test[42]``); else (a stream's scanned labels) its split.

    Returns:
        ``num_classes``, inferred where it was 0.

    Raises:
        HvdtrainError: for an empty split, a label out of ``[0, num_classes)``, fewer than 2
            classes, or a class with no training example when ``num_classes`` is inferred.
    """
    if len(y_train) == 0 or len(y_test) == 0:
        raise HvdtrainError(f"{name}: empty dataset ({len(y_train)} training, {len(y_test)} test examples)")
    low = min(int(y_train.min()), int(y_test.min()))
    high = max(int(y_train.max()), int(y_test.max()))
    inferred = not num_classes
    num_classes = num_classes or high + 1
    if low < 0 or high >= num_classes:
        bad = low if low < 0 else high
        raise HvdtrainError(f"{name}: labels must be in [0, {num_classes}), found range [{low}, {high}]: "
                            f"{bad} at {_where_label(bad, y_train, y_test, positions)}")
    if num_classes < 2:
        raise HvdtrainError(f"{name}: need at least 2 classes, labels only take the value {high}")
    if inferred:  # a corrupt label would otherwise add classes silently (a 200 among 0..9: 201 outputs)
        present = np.unique(y_train)
        missing = num_classes - len(present)
        if missing:
            # The first five missing classes lie below len(present) + 5: no arange over a huge label.
            first = np.setdiff1d(np.arange(min(num_classes, len(present) + 5)), present)[:5]
            shown = ", ".join(map(str, first)) + (f" and {missing - 5} more" if missing > 5 else "")
            raise HvdtrainError(f"{name}: labels must be class indices 0..K-1 with every class in the training "
                                f"set; the labels go up to {high} (at {_where_label(high, y_train, y_test, positions)}), "
                                f"but no training example has class {shown}")
    return num_classes
