"""Durable file writes: a file or a save appears whole, by rename, and survives a power loss."""
import os

from hvdtrain.errors import HvdtrainError


def refuse_a_file_in_the_way(directory: str, what: str, flags: str) -> None:
    """Refuse ``directory`` if it, or a directory above it, is a regular file (no directory can
    be made there).

    Raises:
        HvdtrainError: ``"<what> <directory>: <the file> is a file, not a directory (<flags>)"``.
    """
    path = os.path.abspath(directory)
    while path != os.path.dirname(path):
        if os.path.isfile(path):
            raise HvdtrainError(f"{what} {directory}: {path} is a file, not a directory ({flags})")
        path = os.path.dirname(path)


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
