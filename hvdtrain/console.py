"""What a rank prints: one line, written whole (:func:`say`)."""
from __future__ import annotations

import sys
from typing import Optional, TextIO


def say(text: str, stream: Optional[TextIO] = None) -> None:
    """Write ``text`` and its newline in one write to ``stream`` (default: stdout), then flush.

    With ``PYTHONUNBUFFERED`` (common in containers) ``print()`` writes the newline apart, and
    ``mpirun``'s output tagging then makes it a line of its own, after the text.
    """
    stream = stream or sys.stdout
    stream.write(text + "\n")
    stream.flush()
