"""Stall watchdog: a rank that makes no progress for too long aborts, naming the rank that stalled.

A collective waits for every rank. If one rank is frozen (``kill -STOP``, stuck reading data), lost
without its connections closing (a cut network link), or skipped a collective, the others wait
in it indefinitely: Gloo has timeouts, MPI's TCP transport has none. The trainer calls
:meth:`Watchdog.beat` after every step, and code that enters a collective says so with
:func:`hvdtrain.runtime.dist.in_collective`; if no beat comes for ``timeout`` seconds, the
watchdog prints where the job is stuck and ends the process with exit status 3, so the launcher
(which ends the job when a rank fails) and every other rank stop too.

Which rank stalled: once connected (:meth:`Watchdog.connect`), every rank's watchdog thread sends
rank 0 a UDP heartbeat each second -- its progress and the collective it is in, if any -- and
rank 0 sends its own to every rank. The heartbeats come from a thread of their own, so they go on
while the main thread waits in a collective, and stop only when the whole process is frozen,
killed or cut off. On a timeout, rank 0 names the ranks whose heartbeats stopped and the ranks
stuck outside any collective (e.g. reading data); the other ranks leave the message to rank 0
(or report rank 0 itself, if its heartbeats stopped). Horovod's own stall inspector is set to warn
at half the timeout, when its coordinator can still run.

A lost rank (``kill -9``, the out-of-memory killer, a crash) ends the job within seconds, whatever
the launcher does: under MPI a collective whose peer is gone may never return, and Slurm's srun
signals the remaining tasks but waits its ``KillWait`` (30 s by default) before killing ranks
that cannot act on a signal from inside that collective. So the watchdog thread itself ends this
rank (:meth:`Watchdog.end_job_on_lost_peer`) once a peer is gone without having said why (every
rank says so before it exits: done, stopped, or failed with its own error): a peer on this host
as soon as its process has ended, a peer on another host when its heartbeats have stopped for
:attr:`Watchdog.SILENT_AFTER_SIGNAL_S` seconds after a signal reached this process (a launcher
ending the job signals every rank; :func:`hvdtrain.runtime.signals.signal_arrived`). Rank 0 prints
the one line that names the lost rank (rank 1 when rank 0 was lost); the other ranks leave quietly.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

from hvdtrain.runtime.dist import current_collective
from hvdtrain.runtime.placement import machine_id
from hvdtrain.runtime.signals import signal_arrived

EXIT_STALLED = 3
EXIT_PEER_LOST = 2  # an error, as hvdtrain's others


_FAILED = "FAILED: "
_STOPPED = "STOPPED"
_DONE = "DONE"  # this rank has left the run's collectives: its exit is no loss


def _host_id() -> str:
    """Identifies this machine and PID namespace: containers on one machine share its boot id
    (:func:`machine_id`), not their process ids. The hostname stands in for an unreadable namespace."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = socket.gethostname()
    return f"{machine_id()}/{namespace}"


def _process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (a zombie, ended but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _ipv4_addresses() -> list:
    """This host's IPv4 addresses, loopback first (where heartbeats to this rank may arrive)."""
    addresses = ["127.0.0.1"]
    try:
        import psutil

        for infos in psutil.net_if_addrs().values():
            addresses += [i.address for i in infos if i.family == socket.AF_INET and i.address not in addresses]
    except ImportError:
        pass
    return addresses


class Watchdog:
    """Ends the process if :meth:`beat` is not called for ``timeout_s`` seconds while armed.

    Args:
        rank: returns this process's rank now (:func:`hvdtrain.runtime.dist.current_rank`: the
            launcher's until Horovod starts, Horovod's after, renumbered by elastic resets).
        timeout_s: seconds without progress before aborting; 0 disables the stall check (the
            heartbeats still run, so that a lost rank is named).
        poll_s: how often the watchdog thread checks and sends its heartbeat, seconds.
    """

    # A rank whose heartbeats stopped this long ago is frozen, killed or unreachable (seconds).
    SILENT_AFTER_S = 5.0
    # A non-chief rank that timed out waits this long for rank 0's message before printing its own.
    DEFER_TO_CHIEF_S = 5.0
    # Once a signal has reached this rank, a peer on another host silent this long is lost (seconds).
    SILENT_AFTER_SIGNAL_S = 3.0

    def __init__(self, rank: Callable[[], int], timeout_s: float, poll_s: float = 1.0):
        self._rank_now, self.timeout_s, self.poll_s = rank, float(timeout_s), poll_s
        self._last = time.monotonic()
        self._where = "starting"
        self._stop = threading.Event()
        self._thread = None
        self._sock: Optional[socket.socket] = None
        self._targets: list = []
        self._token = ""
        self._heard: Dict[int, Tuple[float, str, str]] = {}  # rank -> (when heard, last progress, collective)
        self._local_pids: Dict[int, int] = {}
        self._failed = ""
        self._leaving = ""  # _STOPPED or _DONE, once this rank says so
        self._ever_heard: set = set()
        self._describe_lost: Optional[Callable[[List[int]], Tuple[bool, str]]] = None
        self._report_claimed = threading.Lock()

    @property
    def rank(self) -> int:
        """This process's rank now."""
        try:
            return self._rank_now()
        except Exception:  # noqa: BLE001 -- between an elastic reset's shutdown and init
            return -1

    def arm(self, where: str) -> None:
        """Start watching (idempotent); ``where`` says what the rank is doing now."""
        self.beat(where)
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="hvdtrain-watchdog", daemon=True)
            self._thread.start()

    def connect(self, ctx) -> None:
        """Exchange heartbeat addresses with the other ranks (a collective; once, after start-up).

        Every rank binds a UDP socket on all interfaces; rank 0 learns every rank's addresses and
        port, the others rank 0's. A random token, the same on all ranks, keeps other jobs' packets out.
        """
        if ctx.size == 1:
            return
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("0.0.0.0", 0))
        sock.setblocking(False)
        host = _host_id()
        everyone = ctx.allgather_object({"port": sock.getsockname()[1], "addrs": _ipv4_addresses(),
                                         "host": host, "pid": os.getpid()}, name="hvdtrain.watchdog.addresses")
        token = ctx.broadcast_object(os.urandom(8).hex(), name="hvdtrain.watchdog.token")
        peers = range(1, ctx.size) if ctx.is_chief else [0]
        self._targets = [(addr, everyone[r]["port"]) for r in peers for addr in everyone[r]["addrs"]]
        self._token, self._sock = token, sock
        now = time.monotonic()
        self._heard = {r: (now, "start-up", "") for r in peers}
        self._ever_heard = set()
        # Peers on this host, by pid: whether such a peer's process has ended is known at once.
        self._local_pids = {r: everyone[r]["pid"] for r in peers if everyone[r]["host"] == host}

    def beat(self, where: str) -> None:
        """Record progress; ``where`` (e.g. ``"epoch 2, step 17"``) is reported if the next beat never comes.

        Also ends a :meth:`pause`.
        """
        self._where = where
        self._last = time.monotonic()

    def pause(self, where: str, max_s: float) -> None:
        """Suspend the stall check for up to ``max_s`` seconds, or until the next :meth:`beat`: for
        waits that are not stalls (an elastic reset waits for Horovod's driver and for joining
        workers to start up). After ``max_s + timeout_s`` seconds without a beat the rank aborts:
        a worker that never registers leaves Horovod's driver waiting without a timeout."""
        self._where = where
        self._last = time.monotonic() + max_s  # one assignment: read whole by the watchdog thread

    def end_job_on_lost_peer(self, describe: Callable[[List[int]], Tuple[bool, str]]) -> None:
        """From now on, a peer that is gone without having said why ends this rank at once (see
        the module's docstring), with exit status :data:`EXIT_PEER_LOST`.

        Args:
            describe: given the lost ranks, returns ``(report, line)``: whether this rank prints
                ``line`` (the one that names them). Called in the watchdog thread.
        """
        self._describe_lost = describe

    def claim_report(self) -> bool:
        """Whether this caller is the first (and only) one to report a lost peer on this rank:
        the watchdog thread and the main thread may both find it."""
        return self._report_claimed.acquire(blocking=False)

    def close(self) -> None:
        """Stop watching (call in ``finally``); the peers learn that this rank's exit is no loss."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.poll_s)  # its last heartbeat must not follow the final one
        if self._sock is not None:
            if not self._failed:
                self._leaving = self._leaving or _DONE
                self._exchange()
            self._sock.close()
            self._sock = None

    # ---- after a peer was lost ------------------------------------------------------------------
    def report_failure(self, summary: str) -> None:
        """Tell the peers this rank is failing with its own error (it prints it; they need not)."""
        self._failed = summary
        self._exchange()

    def report_stopped(self) -> None:
        """Tell the peers this rank is stopping on purpose (Ctrl-C, SIGTERM): neither failed nor lost."""
        self._leaving = _STOPPED
        self._exchange()

    def lost_peers(self, wait_s: float = 1.5) -> Tuple[Dict[int, str], List[int], List[int]]:
        """After a collective failed because a peer went away, or this rank was stopped:
        ``(failed, lost, stopped)``.

        ``failed`` maps the peers that reported an error of their own to its summary; ``stopped``
        lists the peers that reported being stopped on purpose (:meth:`report_stopped`); ``lost``
        lists the others whose process has ended (known at once on this host) or whose heartbeats
        stopped (``wait_s`` seconds of silence, for other hosts). Returns as soon as a peer failed
        or was lost, or every peer stopped; else after ``wait_s``, so that a peer on another host
        that died while the others were being stopped is still found. Rank 0 knows of every rank,
        the other ranks of rank 0 only.
        """
        deadline = time.monotonic() + wait_s
        while True:
            self._exchange()
            now = time.monotonic()
            heard = list(self._heard.items())
            failed = {r: collective[len(_FAILED):] for r, (_, _, collective) in heard if collective.startswith(_FAILED)}
            stopped = sorted(r for r, (_, _, collective) in heard if collective == _STOPPED)
            lost = sorted(r for r, (when, _, collective) in heard
                          if r not in failed and r not in stopped and collective != _DONE
                          and (not _process_alive(self._local_pids[r]) if r in self._local_pids
                               else r in self._ever_heard and now - when > wait_s))
            if failed or lost or len(stopped) == len(heard) or now >= deadline:
                return failed, lost, stopped
            time.sleep(0.1)

    # ---- the watchdog thread ----------------------------------------------------------------------
    def _exchange(self) -> None:
        """Send this rank's heartbeat and take in the ones that arrived."""
        sock = self._sock
        if sock is None:
            return
        state = _FAILED + self._failed if self._failed else self._leaving or current_collective() or ""
        fields = [self._token, str(self.rank), _one_line(self._where), _one_line(state)]
        message = "\t".join(fields).encode()[:1400]
        for target in self._targets:
            try:
                sock.sendto(message, target)
            except OSError:  # an address of a peer this host cannot reach
                pass
        while True:
            try:
                data = sock.recv(4096)
            except (BlockingIOError, OSError):
                return
            fields = data.decode(errors="replace").split("\t", 3)
            if len(fields) == 4 and fields[0] == self._token and fields[1].isdigit() and int(fields[1]) in self._heard:
                rank, said = int(fields[1]), self._heard[int(fields[1])][2]
                if said in (_DONE, _STOPPED) or said.startswith(_FAILED):  # final: a late packet cannot undo it
                    fields[3] = said
                self._heard[rank] = (time.monotonic(), fields[2], fields[3])
                self._ever_heard.add(rank)

    def _diagnosis(self) -> str:
        """Which ranks stalled, from the heartbeats: silent ones, and ones stuck outside a collective."""
        now = time.monotonic()
        heard = sorted(self._heard.items())
        culprits = [f"rank {r} sent no heartbeat for {now - when:.0f} s (frozen, killed or unreachable; its last "
                    f"reported progress: {where})" for r, (when, where, _) in heard
                    if r in self._ever_heard and now - when > self.SILENT_AFTER_S]
        never = [r for r, _ in heard if r not in self._ever_heard]
        if never:
            culprits.append(f"no heartbeat ever arrived from rank(s) {never} (UDP to this host blocked?)")
        if current_collective() is None:
            culprits.insert(0, f"rank {self.rank} (this rank) is stuck outside any collective after {self._where}")
        culprits += [f"rank {r} is stuck outside any collective after {where}"
                     for r, (when, where, collective) in heard
                     if now - when <= self.SILENT_AFTER_S and not collective and self.rank == 0]
        if culprits:
            return "; ".join(culprits)
        return "no rank identified (every rank that reports is waiting in a collective: one may have skipped it)"

    def _gone(self) -> Tuple[List[int], List[int]]:
        """``(lost, failed)``: the peers gone without a word, and those gone after reporting their own error."""
        now, arrived = time.monotonic(), signal_arrived()
        quick = arrived is not None and now - arrived > self.SILENT_AFTER_SIGNAL_S
        lost, failed = [], []
        for r, (when, _, state) in sorted(self._heard.items()):
            if state in (_STOPPED, _DONE):
                continue
            if (not _process_alive(self._local_pids[r]) if r in self._local_pids
                    else quick and r in self._ever_heard and now - when > self.SILENT_AFTER_SIGNAL_S):
                (failed if state.startswith(_FAILED) else lost).append(r)
        return lost, failed

    def _end_if_a_peer_is_gone(self) -> None:
        lost, failed = self._gone()
        if lost:  # its final heartbeat may have arrived since this poll's exchange
            self._exchange()
            lost, failed = self._gone()
        if not (lost or failed) or not self.claim_report():
            return  # or the main thread reports it
        try:  # claimed: whatever fails here (a closed stderr), this rank must still end
            if lost:
                report, line = self._describe_lost(lost)
                if report:
                    sys.stderr.write(line + "\n")
                    sys.stderr.flush()
            self.report_failure(f"rank(s) {lost or failed} gone")  # the peers leave quietly
        finally:
            os._exit(EXIT_PEER_LOST)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self._exchange()
                if self._describe_lost is not None:
                    self._end_if_a_peer_is_gone()
            except Exception:  # noqa: BLE001 -- heartbeats are best effort; the stall check must go on
                pass
            idle = time.monotonic() - self._last
            if self.timeout_s <= 0 or idle <= self.timeout_s:
                continue
            if self.rank != 0 and (self._chief_alive() or self.rank != 1):
                # Rank 0 hears every rank's heartbeat, times out too and prints the diagnosis once;
                # when it exits, the launcher ends this rank. (Rank 1 speaks for a silent rank 0.)
                # Print only if that does not happen.
                if self._stop.wait(self.DEFER_TO_CHIEF_S):
                    return
                if time.monotonic() - self._last <= self.timeout_s:
                    continue
                idle = time.monotonic() - self._last
            collective = current_collective()
            waiting = f", waiting in {collective}" if collective else ""
            sys.stderr.write(
                f"hvdtrain: error: rank {self.rank} made no progress for {idle:.0f} s after {self._where}{waiting}. "
                f"Stalled: {self._diagnosis()}. Aborting every rank; resume from the last checkpoint with "
                f"--resume.\n")
            sys.stderr.flush()
            self.report_failure("stalled")  # the peers leave quietly
            os._exit(EXIT_STALLED)

    def _chief_alive(self) -> bool:
        """Rank 0's heartbeats arrive (or never did: then assume it is alive and let it speak)."""
        if 0 not in self._ever_heard:
            return True
        return time.monotonic() - self._heard[0][0] <= self.SILENT_AFTER_S
