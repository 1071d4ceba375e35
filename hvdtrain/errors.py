"""What can go wrong, and how a rank's run ends: hvdtrain's exception types.

Two kinds of types live here:

* errors raised where a problem is found: :class:`HvdtrainError` (a problem the user can fix) and
  :class:`EveryRankError` (one found alike on every rank), :class:`FoundHere` and
  :class:`PeerFailure` (the two sides of an error the ranks agreed on, see
  :meth:`hvdtrain.runtime.dist.DistContext.agree`) and :class:`PeerLost` (a peer went away);
* :class:`RunEnded`, the one outcome a failed or stopped run ends with. :func:`hvdtrain.ending.run_scope`
  turns whatever ended the run into it, once; :func:`hvdtrain.ending.leave` maps its
  :class:`Ending` to what the rank prints and its exit status.
"""
from __future__ import annotations

import enum
from typing import List, Optional


class HvdtrainError(Exception):
    """A user-facing error: bad flags, data, model or checkpoint.

    The entry point prints its message once (``hvdtrain: error: <message>``) and every rank exits
    with status 2, instead of a traceback per rank. Messages name the offending input and the value
    received, e.g. ``--batch-size must be >= 1, got 0``.
    """


class EveryRankError(HvdtrainError):
    """An :class:`HvdtrainError` raised alike on every rank at the same point: found from what every
    rank holds the same (the config, the shard plan, allreduced values). The rank 0 of now prints it."""


class FoundHere(Exception):
    """This rank's ``error``, which every rank learned of in an agreement (``DistContext.agree``):
    this rank prints it, the others raise :class:`PeerFailure`, and all leave through Horovod's
    shutdown.

    Args:
        error: what this rank raised.
    """

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


class PeerFailure(Exception):
    """Raised on the ranks that did *not* find an error another rank reported during an agreement
    (``DistContext.agree``): the rank that found it prints the message, the others exit non-zero
    quietly, so the error appears once."""


class PeerLost(Exception):
    """A collective failed because another rank failed or its process ended mid-training.

    Args:
        message: what happened, naming the rank where known.
        report: whether this rank prints the message (rank 0, unless the failed rank printed its
            own error; or the lowest surviving rank when rank 0 itself was lost).
    """

    def __init__(self, message: str, report: bool):
        super().__init__(message)
        self.report = report


_PEER_LOSS_SIGNS = (
    "HorovodInternalError",            # Horovod's own exception type
    "Horovod has been shut down",      # a collective issued after the background loop stopped
    "gloo/transport",                  # Gloo's TCP pair saw the peer's socket close or reset
    "Connection reset by peer",
    "Connection closed by peer",
)


def is_peer_loss(error: BaseException) -> bool:
    """True for the errors a rank sees when another rank dies mid-collective; never for an
    :class:`HvdtrainError`, this rank's own (whose message may quote an OS error such as a network
    file system's "Connection reset by peer")."""
    if isinstance(error, HvdtrainError):
        return False
    text = f"{type(error).__name__}: {error}"
    return any(sign in text for sign in _PEER_LOSS_SIGNS)


class Ending(enum.Enum):
    """How a rank leaves a run that did not finish (:class:`RunEnded`)."""

    REPORT = "prints the message, then exits with status 2 through Horovod's shutdown"
    QUIET = "leaves the message to another rank and exits with status 2 after a pause"
    ALONE = ("prints its own failure and exits with status 2 at once: its peers are mid-collective, "
             "and Horovod's shutdown would wait for them")
    INTERRUPTED = ("Ctrl-C: the rank 0 of now says where to resume; every rank exits with status 130 without "
                   "Horovod's shutdown (the others after a pause that lets rank 0 print)")
    TERMINATED = ("SIGTERM or SIGUSR1: the rank 0 of now says where to resume; every rank exits without "
                  "Horovod's shutdown (the others after a pause that lets rank 0 print), with status 75 after "
                  "a stop at an agreed step (checkpointed), else 143")


class RunEnded(Exception):
    """The outcome of a run that failed or was stopped, decided once (:func:`hvdtrain.ending.run_scope`).

    Args:
        ending: how this rank leaves.
        cause: what ended the run on this rank.
        message: what this rank prints (``hvdtrain: error: ...``, or the line saying where to
            resume), or None: nothing, or ``cause``'s traceback if ``traceback``.
        traceback: print ``cause``'s traceback (this rank's own failure that is no
            :class:`HvdtrainError`: a bug, or an error of TensorFlow's).
        run_dir: the run directory to ``--resume`` from, or None if no checkpoint directory exists.
    """

    def __init__(self, ending: Ending, cause: BaseException, message: Optional[str] = None,
                 traceback: bool = False, run_dir: Optional[str] = None):
        super().__init__(message or f"{ending.name.lower()}: {type(cause).__name__}: {cause}")
        self.ending, self.cause, self.message, self.traceback, self.run_dir = ending, cause, message, traceback, run_dir


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
