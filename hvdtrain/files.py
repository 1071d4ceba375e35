"""Durable file writes: a file or a save appears whole, by rename, and survives a power loss."""
import os
from typing import Optional


def file_in_the_way(directory: str) -> Optional[str]:
    """The path of ``directory``, or of a directory above it, that is a regular file (so no
    directory can be made there), or None."""
    path = os.path.abspath(directory)
    while path != os.path.dirname(path):
        if os.path.isfile(path):
            return path
        path = os.path.dirname(path)
    return None


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, fsynced, and a rename: a reader, or a
    crash (power loss included), sees the old file or the new one, never a part or nothing."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
