"""Import TensorFlow without its start-up banner: the lines every process prints while TensorFlow's
shared libraries load, which no setting silences and which, once per rank, would bury hvdtrain's.

TensorFlow 2.21 logs through absl before absl's logging is initialised, so neither
``TF_CPP_MIN_LOG_LEVEL`` nor absl's flags reach them. While TensorFlow is imported, file
descriptor 2 is a pipe that a thread reads line by line, passing every line but the banner's
(:data:`BANNER`) on to the real stderr as it comes: a warning or an error comes through, also
from an import that crashes. ``TF_CPP_MIN_LOG_LEVEL=0`` asks for TensorFlow's INFO lines: then
the banner comes through too.
"""
from __future__ import annotations

import os
import re
import sys
import threading

JOIN_TIMEOUT_S = 5.0  # for the pipe's last lines once TensorFlow is imported
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
    stderr = os.dup(2)
    read_end, write_end = os.pipe()
    passer = threading.Thread(target=_pass_on, args=(read_end, stderr), name="hvdtrain-tf-banner", daemon=True)
    passer.start()
    os.dup2(write_end, 2)
    os.close(write_end)
    try:
        import tensorflow
    finally:
        sys.stderr.flush()
        os.dup2(stderr, 2)  # closes the pipe's last write end: the thread reads to its end
        passer.join(timeout=JOIN_TIMEOUT_S)
        if not passer.is_alive():  # else a copy of the write end lives on: the thread passes its lines on
            os.close(stderr)
    return tensorflow


def _pass_on(read_end: int, stderr: int) -> None:
    """Copy lines from ``read_end`` to ``stderr`` (file descriptors), without the banner's, until EOF."""
    with os.fdopen(read_end, "rb") as lines:
        for line in lines:
            if without_banner(line.decode(errors="replace")):
                os.write(stderr, line)
