"""The one exception type hvdtrain raises for problems a user can fix, and helpers for its messages."""
import sys
from typing import List, Optional, TextIO


class HvdtrainError(Exception):
    """A user-facing error: bad flags, data, model or checkpoint.

    The entry point prints its message once (``hvdtrain: error: <message>``) and every rank exits
    with status 2, instead of a traceback per rank. Messages name the offending input and the value
    received, e.g. ``--batch-size must be >= 1, got 0``.
    """


def describe_differences(ours: dict, theirs: dict, there: str, prefix: str = "") -> List[str]:
    """Name each key of ``ours`` whose value ``theirs`` lacks or holds differently, for an error message.

    Args:
        ours: this process's values.
        theirs: the values to compare with (a missing key counts as ``None``; keys only here are
            not compared).
        there: where ``theirs`` come from, e.g. ``"on rank 0"`` or ``"there"``.
        prefix: prepended to every key (used for nested dicts).

    Returns:
        ``["key: <ours> here, <theirs> <there>", ...]`` in ``ours``' key order; a key whose values are
        both dicts is compared key by key and named ``key.sub``.
    """
    differences = []
    for key, mine in ours.items():
        other = theirs.get(key)
        if other == mine:
            continue
        if isinstance(mine, dict) and isinstance(other, dict):
            differences += describe_differences(mine, other, there, f"{prefix}{key}.")
        else:
            differences.append(f"{prefix}{key}: {mine!r} here, {other!r} {there}")
    return differences


def say(text: str, stream: Optional[TextIO] = None) -> None:
    """Write ``text`` and its newline in one write to ``stream`` (default: stdout), then flush.

    With ``PYTHONUNBUFFERED`` (common in containers) ``print()`` writes the newline apart, and
    ``mpirun``'s output tagging then makes it a line of its own, after the text.
    """
    stream = stream or sys.stdout
    stream.write(text + "\n")
    stream.flush()
