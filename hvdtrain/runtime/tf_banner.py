"""Import TensorFlow without its start-up banner: the lines every process prints while TensorFlow's
shared libraries load, which no setting silences and which, once per rank, would bury hvdtrain's.

TensorFlow 2.21 logs through absl before absl's logging is initialised, so neither
``TF_CPP_MIN_LOG_LEVEL`` nor absl's flags reach them. What TensorFlow's import writes to file
descriptor 2 is kept aside and written back after it, without the banner's lines (:data:`BANNER`);
everything else (a warning, an error) comes through. ``TF_CPP_MIN_LOG_LEVEL=0`` asks for
TensorFlow's INFO lines: then the banner comes through too.
"""
from __future__ import annotations

import os
import re
import sys
import tempfile

BANNER = tuple(re.compile(pattern) for pattern in (
    r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$",
    r"I\d{4} [\d:.]+\s+\d+ port\.cc:\d+\] oneDNN custom operations are on\.",
    r"I\d{4} [\d:.]+\s+\d+ cpu_feature_guard\.cc:\d+\] This TensorFlow binary is optimized",
    r"To enable the following instructions: .*, in other operations, rebuild TensorFlow with the appropriate",
))


def without_banner(text: str) -> str:
    """``text`` (lines of stderr) without TensorFlow's start-up banner lines."""
    return "".join(line for line in text.splitlines(keepends=True)
                   if not any(pattern.match(line) for pattern in BANNER))


def import_tensorflow():
    """``import tensorflow``, with its start-up banner left out of this process's stderr (unless
    ``TF_CPP_MIN_LOG_LEVEL`` is 0); a TensorFlow already imported is returned as it is.

    Returns:
        The ``tensorflow`` module.

    Raises:
        ImportError: as ``import tensorflow`` does, after what it printed.
    """
    if "tensorflow" in sys.modules or os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0") in ("", "0"):
        import tensorflow

        return tensorflow
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            import tensorflow
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = without_banner(capture.read().decode(errors="replace"))
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()
    return tensorflow
