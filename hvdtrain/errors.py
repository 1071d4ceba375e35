"""The one exception type hvdtrain raises for problems a user can fix."""


class HvdtrainError(Exception):
    """A user-facing error: bad flags, data, model or checkpoint.

    The entry point prints its message once (``hvdtrain: error: <message>``) and every rank exits
    with status 2, instead of a traceback per rank. Messages name the offending input and the value
    received, e.g. ``--batch-size must be >= 1, got 0``.
    """
