"""Distributed state: Horovod start-up, device and thread pinning, and rank coordination.

Everything that asks Horovod "who am I?" lives here. The rest of hvdtrain receives one
:class:`DistContext` explicitly instead of calling ``hvd.rank()`` wherever it likes, so that which
code runs on which rank can be read off the call sites.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Callable, Optional, Sequence, TypeVar

import numpy as np

from hvdtrain.errors import HvdtrainError, say
from hvdtrain.watchdog import configure_horovod_stall_check, in_collective, machine_id

T = TypeVar("T")

# Environment variables through which the common launchers tell a process its global rank, read
# before Horovod starts (to print argument errors once, from rank 0 only).
_RANK_ENV_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")


def launcher_rank() -> int:
    """The global rank the launcher gave this process, read from the environment.

    Usable before ``hvd.init()`` (e.g. for argument errors). Returns 0 when no launcher variable is
    set, i.e. for a plain ``python -m hvdtrain``.
    """
    for name in _RANK_ENV_VARS:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def current_rank() -> int:
    """This process's rank now: Horovod's while it runs (an elastic reset renumbers the workers, and
    the worker the launcher started as rank 0 may be gone), else :func:`launcher_rank`."""
    hvd = sys.modules.get("horovod.tensorflow")
    if hvd is not None and hvd.is_initialized():
        return hvd.rank()
    return launcher_rank()


class PeerFailure(Exception):
    """Raised on the ranks that did *not* find an error another rank reported during :meth:`DistContext.agree`.

    The rank that found it prints the message; the others exit non-zero quietly, so the error
    appears once.
    """


class PeerLost(Exception):
    """A collective failed because another rank failed or its process ended mid-training.

    Attributes:
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


@dataclasses.dataclass(frozen=True)
class DistContext:
    """Who this process is in the job, and where it computes. Created by :func:`init_distributed`.

    Attributes:
        rank: global rank in ``[0, size)``.
        local_rank: rank among the processes on this host, ``[0, local_size)``; selects the GPU.
        size: world size, the number of processes in the job.
        local_size: number of processes on this host.
        cross_size: number of hosts.
        device: TensorFlow device this rank computes on: ``"/GPU:0"`` (its own GPU, the only one
            it sees) or ``"/CPU:0"``.
        cpu_cores: the CPU cores every thread of this process is pinned to (see :func:`_cpu_shares`).
        intra_op_threads: TensorFlow intra-op thread-pool size.
        elastic_startup: an elastic worker starting up, before its first state sync: it may
            start alone while the others wait in that sync, so :meth:`agree` runs no collective.
            :meth:`refreshed` (after the sync) clears it.
        horovod_threads: ids of the threads ``hvd.init`` started in this process (Horovod's
            background loop, MPI's or Gloo's helpers), for diagnostics such as
            ``benchmarks/thread_time.py``. Not updated after an elastic reset, when Horovod
            restarts its threads.
    """

    rank: int
    local_rank: int
    size: int
    local_size: int
    cross_size: int
    device: str
    cpu_cores: tuple
    intra_op_threads: int
    elastic_startup: bool = False
    horovod_threads: frozenset = frozenset()

    @property
    def is_chief(self) -> bool:
        """True on rank 0, the only rank that prints, logs and writes checkpoints."""
        return self.rank == 0

    # ---- coordination -----------------------------------------------------------------------
    def allreduce_sum(self, values: Sequence[float], name: str) -> np.ndarray:
        """Sum a small float64 vector over all ranks (eager; for metrics and agreement, not gradients).

        Args:
            values: the local vector, same length on every rank.
            name: collective name, identical on every rank for the same call.

        Returns:
            ``np.ndarray`` of float64, the element-wise sum over ranks.
        """
        import horovod.tensorflow as hvd
        import tensorflow as tf

        local = tf.constant(np.asarray(values, dtype=np.float64))
        if self.size == 1:
            return local.numpy()
        with in_collective(f"allreduce {name}"):
            return hvd.allreduce(local, op=hvd.Sum, name=name).numpy()

    def broadcast_object(self, obj, name: str):
        """Rank 0's ``obj`` on every rank (a small picklable Python value created by hvdtrain itself)."""
        if self.size == 1:
            return obj
        import horovod.tensorflow as hvd

        with in_collective(f"broadcast {name}"):
            return hvd.broadcast_object(obj, root_rank=0, name=name)

    def agree(self, error: Optional[BaseException], what: str) -> None:
        """Make every rank fail together if any rank hit an error during ``what``.

        A collective: every rank must call it at the same point. Ranks that are fine would otherwise
        wait forever in the next collective for a rank that has died or is about to raise.

        Args:
            error: the exception this rank caught during ``what``, or None.
            what: a short description for the message, e.g. ``"loading data"``.

        Raises:
            The rank's own ``error`` on the lowest failing rank (which prints it), and
            :class:`PeerFailure` on every other rank, whenever any rank passed an error.
        """
        if self.elastic_startup:
            # A worker that joins an elastic job later runs start-up alone while the others wait
            # in the state sync: a collective here would pair with theirs and deadlock. Each
            # worker checks its own start-up; one that fails leaves, and the job goes on without it.
            if error is not None:
                error.rank_found = True
                raise error
            return
        flags = self.allreduce_sum(
            [1.0 if r == self.rank and error is not None else 0.0 for r in range(self.size)],
            name=f"hvdtrain.agree.{what.replace(' ', '_')}",
        )
        failing = np.flatnonzero(flags)
        if failing.size == 0:
            return
        if self.rank == failing[0]:
            error.rank_found = True  # this rank prints it (see hvdtrain.cli.main); every rank raises here
            raise error
        raise PeerFailure(f"rank {failing[0]} failed while {what}")

    def guarded(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn()`` on this rank, then :meth:`agree` on the outcome: all ranks succeed or all raise.

        A collective. Use it for start-up work that can fail on some ranks only (reading files,
        importing a user's model), so the healthy ranks stop instead of hanging in the next collective.

        Returns:
            ``fn()``'s result.
        """
        result, error = None, None
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 -- re-raised by agree() on the rank that hit it
            error = e
        self.agree(error, what)
        return result

    def refreshed(self) -> "DistContext":
        """This context with the rank, local rank and sizes Horovod has now (after an elastic state sync).

        The device and CPU cores stay: TensorFlow fixes them when its runtime starts.
        """
        import horovod.tensorflow as hvd

        return dataclasses.replace(self, rank=hvd.rank(), local_rank=hvd.local_rank(), size=hvd.size(),
                                   local_size=hvd.local_size(), cross_size=hvd.cross_size(), elastic_startup=False)

    def close(self) -> None:
        """Shut Horovod down (idempotent). Call in ``finally``."""
        import horovod.tensorflow as hvd

        if hvd.is_initialized():
            hvd.shutdown()


_SLOT_LOCKS: list = []  # open lock files, held for the life of the process


def _machine_slot(max_slots: int = 256) -> int:
    """The lowest slot index no other hvdtrain process of this user holds on this machine.

    A slot is an exclusive ``flock`` on ``<tmp>/hvdtrain-<uid>-slot-<i>.lock``, held until the
    process exits (the kernel releases it even after ``kill -9``, so a replacement worker gets
    the slot, and the GPU, of the one it replaces).

    Raises:
        HvdtrainError: if all ``max_slots`` slots are held.
    """
    import fcntl
    import tempfile

    for slot in range(max_slots):
        lock = open(os.path.join(tempfile.gettempdir(), f"hvdtrain-{os.getuid()}-slot-{slot}.lock"), "a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            continue
        _SLOT_LOCKS.append(lock)
        return slot
    raise HvdtrainError(f"more than {max_slots} hvdtrain workers on this machine")


def _launch_cores() -> frozenset:
    """The CPUs this process's parent may run on: those of the launcher or its daemon (``mpirun``,
    ``orted``, ``slurmstepd``, ``horovodrun``), which a launcher's binding of this process narrows;
    this process's own where the parent's cannot be read. (A wrapper between launcher and rank,
    ``mpirun ... bash wrap.sh``, has the rank's binding: :func:`_expected_share` then guesses.)"""
    try:
        return frozenset(os.sched_getaffinity(os.getppid()))
    except OSError:
        return frozenset(os.sched_getaffinity(0))


def _parse_cpu_list(text: str) -> frozenset:
    """The CPUs of a Linux CPU list such as ``0-3,8,10-11`` (sysfs format)."""
    cpus = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


def _topology(cpu: int) -> tuple:
    """``(socket, first CPU of its physical core)`` of logical CPU ``cpu``, from sysfs: CPUs with
    the same answer are hyperthreads of one core. ``(0, cpu)`` where sysfs does not say."""
    base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
    try:
        with open(f"{base}/physical_package_id") as f, open(f"{base}/thread_siblings_list") as g:
            return int(f.read()), min(_parse_cpu_list(g.read()) | {cpu})
    except (OSError, ValueError):
        return 0, cpu


def _physical_cores(cpus, topology) -> list:
    """``cpus`` grouped by physical core (hyperthreads together), in socket and core order.

    Args:
        cpus: logical CPU ids (ints).
        topology: :func:`_topology`'s answer for each of them (a mapping).

    Returns:
        Lists of ints, one per physical core.
    """
    cores = {}
    for cpu in sorted(cpus, key=lambda c: (*topology[c], c)):
        cores.setdefault(topology[cpu], []).append(cpu)
    return list(cores.values())


def _slice(cpus, index: int, count: int, topology) -> tuple:
    """Slice ``index`` of ``count`` equal contiguous slices of ``cpus``: of whole physical cores
    where they divide evenly among the ``count``, else of logical CPUs in core order (a core's
    hyperthreads adjacent, so at most the cores at the slices' edges are split); all of ``cpus``
    when there are fewer than ``count`` (oversubscribed).

    Args:
        cpus: logical CPU ids (ints).
        index: which slice, in ``[0, count)``.
        count: the number of slices.
        topology: :func:`_topology`'s answer for every one of ``cpus`` (a mapping).

    Returns:
        The slice's CPUs (ints, ascending).
    """
    cores = _physical_cores(cpus, topology)
    if len(cores) % count == 0:
        per_rank = len(cores) // count
        return tuple(sorted(cpu for core in cores[index * per_rank:(index + 1) * per_rank] for cpu in core))
    flat = [cpu for core in cores for cpu in core]
    if count > len(flat):
        return tuple(sorted(flat))
    per_rank = len(flat) // count
    return tuple(sorted(flat[index * per_rank:(index + 1) * per_rank]))


def _overlap_groups(bindings) -> list:
    """The ranks in groups connected by CPUs they may both run on: ranks of one group share CPUs
    with one another, directly or through other ranks of the group; ranks of different groups
    share none (union-find over the CPUs).

    Args:
        bindings: the CPUs (sets of ints) each rank may run on, in rank order.

    Returns:
        Lists of indices into ``bindings``, ascending, in order of their lowest index.
    """
    parent = list(range(len(bindings)))

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first_rank_of = {}
    for i, cpus in enumerate(bindings):
        for cpu in cpus:
            j = first_rank_of.setdefault(cpu, i)
            parent[root(i)] = root(j)
    groups = {}
    for i in range(len(bindings)):
        groups.setdefault(root(i), []).append(i)
    return sorted(groups.values())


def _share_overlapping(bindings, topology) -> list:
    """Disjoint parts of bindings that overlap without being the same (one group of
    :func:`_overlap_groups`).

    First one CPU for every rank wherever the bindings allow that (a maximum bipartite matching
    by augmenting paths: Kuhn 1955, "The Hungarian method for the assignment problem"), the most
    narrowly bound rank first; then, in turns, one free CPU of its binding at a time to each rank
    with fewer than an equal part of the group's CPUs, preferring a hyperthread of a core it
    holds, then a CPU that fewer other bindings contain (so a widely bound rank leaves a narrowly
    bound one its CPUs); then every CPU still free to the rank, among those bound to it, that
    holds the fewest. A rank left without a CPU shares its binding's least used one.

    Args:
        bindings: the CPUs (frozensets of ints) each rank of the group may run on, in rank order.
        topology: :func:`_topology`'s answer for every one of those CPUs (a mapping).

    Returns:
        Each rank's CPUs (tuples of ints, ascending), in the order of ``bindings``.
    """
    every = frozenset().union(*bindings)
    position = {cpu: k for k, cpu in enumerate(sorted(every, key=lambda c: (*topology[c], c)))}
    contained = {cpu: sum(cpu in cpus for cpus in bindings) for cpu in every}
    in_order = [sorted(cpus, key=lambda c: (contained[c], position[c])) for cpus in bindings]
    narrowest_first = sorted(range(len(bindings)), key=lambda i: (len(bindings[i]), i))
    owner = {}

    def augment(i, seen):
        for cpu in in_order[i]:
            if cpu not in seen:
                seen.add(cpu)
                if cpu not in owner or augment(owner[cpu], seen):
                    owner[cpu] = i
                    return True
        return False

    for i in narrowest_first:
        augment(i, set())
    shares = [[cpu for cpu in in_order[i] if owner.get(cpu) == i] for i in range(len(bindings))]
    equal_part = max(1, len(every) // len(bindings))
    taking = True
    while taking:
        taking = False
        for i in narrowest_first:
            free = [cpu for cpu in in_order[i] if cpu not in owner]
            if free and len(shares[i]) < equal_part:
                held = {topology[cpu] for cpu in shares[i]}
                cpu = min(free, key=lambda c: (topology[c] not in held, contained[c], position[c]))
                owner[cpu] = i
                shares[i].append(cpu)
                taking = True
    for cpu in sorted(every - owner.keys(), key=position.get):  # none idle that a rank may run on
        i = min((i for i in narrowest_first if cpu in bindings[i]), key=lambda i: len(shares[i]))
        owner[cpu] = i
        shares[i].append(cpu)
    for i in range(len(bindings)):
        if not shares[i]:
            shares[i] = [min(in_order[i], key=lambda c: sum(c in s for s in shares))]
    return [tuple(sorted(s)) for s in shares]


def _cpu_shares(bindings: Sequence, topology) -> tuple:
    """The CPUs each rank on one machine should use: CPUs of its own where there are enough.

    Ranks whose launcher let them run on the same CPUs (all of a host's, a container's cpuset, a
    ``taskset`` around the launcher, or one socket that ``mpirun --bind-to socket`` bound several
    ranks to) split them into equal slices (:func:`_slice`), in rank order. A rank whose binding
    no other rank shares (``mpirun --bind-to core``, ``--map-by slot:PE=4``, ``srun
    --cpu-bind=cores``) keeps it. Ranks whose bindings overlap without being the same get
    disjoint parts of them where that is possible (:func:`_share_overlapping`).

    Args:
        bindings: the CPUs (sets of ints) that each rank on this machine may run on, in rank order.
        topology: :func:`_topology`'s answer for every one of those CPUs (a mapping).

    Returns:
        ``(shares, overlapping)``: each rank's CPUs (tuples of ints, ascending), in the order of
        ``bindings``, and the indices of the ranks whose bindings overlap without being the same.
    """
    bindings = [frozenset(cpus) for cpus in bindings]
    shares, overlapping = [()] * len(bindings), []
    for group in _overlap_groups(bindings):
        if len({bindings[i] for i in group}) == 1:
            for k, i in enumerate(group):
                shares[i] = _slice(bindings[i], k, len(group), topology)
        else:
            for i, share in zip(group, _share_overlapping([bindings[i] for i in group], topology)):
                shares[i] = share
            overlapping += group
    return tuple(shares), sorted(overlapping)


def _expected_share(own, launch_cpus, local_size: int) -> int:
    """How many CPUs this rank will likely get (:func:`_cpu_shares`; the CPUs per rank, when
    oversubscribed), before the ranks compare their bindings: TensorFlow's thread pools are sized
    before its runtime starts, and the comparison is a collective, which starts it. Ranks are
    taken to share this rank's binding in proportion to its part of the launcher's CPUs: all
    local ranks when unbound, only this one when bound to a ``local_size``-th or less.

    Args:
        own: the CPUs this process may run on.
        launch_cpus: the CPUs its launcher may run on (:func:`_launch_cores`).
        local_size: the number of ranks on this host.

    Returns:
        The number of CPUs, at least 1.
    """
    universe = len(frozenset(launch_cpus) | frozenset(own))
    sharing = min(local_size, max(1, -(-local_size * len(own) // universe)))  # ceil
    return max(1, len(own) // sharing)


def _agreed_cpu_share(hvd, rank: int, own, intra: int, threads_given: bool) -> tuple:
    """This rank's CPUs (:func:`_cpu_shares`), from every rank's machine, binding and topology,
    which the ranks exchange (an allgather; every rank must call it at the same point), so that
    every rank computes the same assignment.

    Rank 0 prints one warning naming the ranks whose bindings overlap without being the same,
    and, unless the user set the thread pools' size (``--threads``), one naming the ranks whose
    pool (sized before the exchange) is not one thread per CPU they got.

    Args:
        hvd: ``horovod.tensorflow``, initialized.
        rank: this process's rank.
        own: the CPUs this process may run on.
        intra: the size of this rank's TensorFlow intra-op thread pool.
        threads_given: whether the user set that size.

    Returns:
        The CPUs (ints, ascending).

    Raises:
        horovod.common.exceptions.HorovodInternalError: if the allgather fails (a rank lost).
    """
    topology = {cpu: _topology(cpu) for cpu in own}
    if hvd.size() == 1:
        return _slice(own, 0, 1, topology)
    with in_collective("comparing the ranks' CPU bindings (allgather)"):
        everyone = hvd.allgather_object((machine_id(), sorted(own), intra, topology), name="hvdtrain.cpu_bindings")
    shares, per_rank, overlapping = [()] * len(everyone), [1] * len(everyone), []
    for machine in dict.fromkeys(m for m, _, _, _ in everyone):
        on_machine = [r for r, (m, _, _, _) in enumerate(everyone) if m == machine]
        known = {cpu: tuple(where) for r in on_machine for cpu, where in everyone[r][3].items()}
        machine_shares, overlap = _cpu_shares([everyone[r][1] for r in on_machine], known)
        for r, cpus in zip(on_machine, machine_shares):
            shares[r] = cpus  # oversubscribed ranks hold the same CPUs: one thread per CPU each would be too many
            per_rank[r] = max(1, len(cpus) // machine_shares.count(cpus))
        overlapping += [on_machine[i] for i in overlap]
    mismatched = [r for r, (_, _, pool, _) in enumerate(everyone) if pool != per_rank[r]]
    if rank == 0 and overlapping:
        say(f"hvdtrain: warning: the launcher bound {_ranks(overlapping)} to CPUs that overlap without being the "
            f"same; hvdtrain gave each rank part of its binding, which may leave CPUs idle or shared: start "
            f"mpirun with -bind-to none -map-by slot (horovodrun does), srun with --cpu-bind=none, or bind each "
            f"rank to CPUs of its own", sys.stderr)
    if rank == 0 and mismatched and not threads_given:
        said = ", ".join(f"rank {r}: {everyone[r][2]} for {per_rank[r]}" for r in mismatched[:4])
        say(f"hvdtrain: warning: {_ranks(mismatched)} sized TensorFlow's thread pool, before the ranks compared "
            f"CPU bindings, for another number of CPUs than they got (threads for CPUs: {said}): set --threads, "
            f"or start the ranks unbound (mpirun -bind-to none)", sys.stderr)
    return shares[rank]


def _ranks(ranks: Sequence[int], shown: int = 8) -> str:
    """``ranks`` for a message: ``rank 3``, ``ranks 0, 1, 2``, or ``ranks 0, 1, ..., 7, ... (300 ranks)``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    listed = ", ".join(map(str, ranks[:shown]))
    return f"ranks {listed}" if len(ranks) <= shown else f"ranks {listed}, ... ({len(ranks)} ranks)"


def _thread_ids() -> set:
    return {int(t) for t in os.listdir("/proc/self/task")} if os.path.isdir("/proc/self/task") else set()


def _placed_elsewhere(thread_ids) -> set:
    """The threads among ``thread_ids`` whose CPU affinity differs from the calling thread's: those
    something else (Horovod, for ``HOROVOD_THREAD_AFFINITY``) has placed on cores of its own."""
    own, placed = os.sched_getaffinity(0), set()
    for tid in thread_ids:
        try:
            if os.sched_getaffinity(tid) != own:
                placed.add(tid)
        except ProcessLookupError:  # the thread has exited meanwhile
            pass
    return placed


def _pin_threads(cores, skip=()) -> None:
    """Confine every thread of this process, not only the calling one, to ``cores``.

    ``sched_setaffinity`` binds one thread, and threads started before it keep their affinity:
    Horovod's background loop and MPI's helpers (started by ``hvd.init``) and TensorFlow's
    early threads would otherwise run on every core of the host, the other ranks' included.
    Threads started later inherit the affinity of the thread that starts them.

    Args:
        cores: the CPU cores (ints).
        skip: thread ids to leave as they are.
    """
    for tid in (_thread_ids() or {0}) - set(skip):
        try:
            os.sched_setaffinity(tid, cores)
        except ProcessLookupError:  # the thread has exited meanwhile
            pass


def _yield_to_compute(thread_ids) -> None:
    """Run Horovod's own threads (its background loop, MPI's and Gloo's helpers) at nice 19.

    They share a CPU rank's cores with TensorFlow's compute threads. Horovod's loop wakes every
    ``HOROVOD_CYCLE_TIME`` (0.1 ms here) to coordinate, even with nothing to do, and under MPI it
    busy-polls while waiting for a peer; at normal priority both preempt the compute. At nice 19
    they still run at once whenever the compute waits for them (an allreduce result), and take
    little CPU while it computes. Measured (benchmarks/scaling.py, seed CNN, one core per rank):
    np=1 2,520 -> 2,900 img/s; np=2 over MPI 3,320 -> 5,290 img/s. Not under Gloo: its
    TCP transport needs the loop's prompt answers, and np=2 lost 5%. Nice 10 and 4 measured
    4,140 and 4,200 img/s against 4,980 at 19. ``HVDTRAIN_HOROVOD_NICE`` overrides the level (0:
    leave them be). Best effort: a thread that cannot be reniced is left as it is.
    """
    nice = int(os.environ.get("HVDTRAIN_HOROVOD_NICE", "19"))
    for tid in thread_ids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:
            pass


def init_distributed(threads: int = 0, use_gpu: bool = True, stall_timeout: float = 0.0,
                     elastic: bool = False, watchdog=None) -> DistContext:
    """Start Horovod and pin this process to its own GPU (or its own CPU cores).

    Must run before any TensorFlow op: device visibility and thread pools are fixed once
    TensorFlow's runtime starts.

    Args:
        threads: TensorFlow intra-op threads; 0 = one per core this rank expects to get (see
            :func:`_expected_share`; rank 0 warns of ranks that got another number).
        use_gpu: use the GPU at the local rank if the host has GPUs; False forces the CPU.
        stall_timeout: seconds after which Horovod's stall inspector should report missing ranks
            is half this (see :mod:`hvdtrain.watchdog`); 0 leaves Horovod's default.
        elastic: the process was started by Horovod's elastic driver (see :mod:`hvdtrain.elastic`).
        watchdog: a :class:`hvdtrain.watchdog.Watchdog` to arm as soon as ``hvd.init()`` returns,
            with this process's rank, so that a rank wedged while pinning (a faulted GPU's query,
            say) ends the job instead of leaving the others in the pinning collective. Not
            before: ``hvd.init()`` waits for every rank to start, which may take long on a cluster.

    Returns:
        The :class:`DistContext` for this process.

    Raises:
        HvdtrainError: with ``elastic`` but no elastic launcher (``HOROVOD_ELASTIC`` unset).
        HvdtrainError: if a host has GPUs but fewer than its local ranks (two ranks sharing one GPU
            is the "all memory grabbed, one GPU computing" pitfall), on the lowest such rank, which
            prints it; the other ranks raise :class:`PeerFailure`.
    """
    import horovod.tensorflow as hvd
    import tensorflow as tf

    # Horovod's background thread checks for ready collectives once per cycle (default 1 ms). Each
    # synchronized BatchNorm layer makes two small blocking allreduces per step, so that latency is
    # paid many times per step: 0.1 ms cuts the synchronized-BatchNorm overhead on the seed CNN from
    # ~29% to ~13% (benchmarks/bn_overhead.py). A user's own setting wins.
    os.environ.setdefault("HOROVOD_CYCLE_TIME", "0.1")
    configure_horovod_stall_check(stall_timeout)
    if elastic:
        if os.environ.get("HOROVOD_ELASTIC") != "1":
            raise HvdtrainError("--elastic: this process was not started by an elastic launcher; use horovodrun "
                                "with --min-np/--max-np and --host-discovery-script (see launch/elastic.sh)")
        # Horovod's response cache lets ranks skip negotiating tensors they all saw before. A
        # worker that survived a reset keeps entries a joining worker lacks: here the first step
        # after a worker joined aborted the survivor (Gloo "op.preamble.length <= op.nbytes",
        # fused buffers of different sizes) until the cache was off. A user's setting wins.
        os.environ.setdefault("HOROVOD_CACHE_CAPACITY", "0")

    # Init: starts the background thread that negotiates and runs collectives (Gloo or MPI).
    threads_before = _thread_ids()
    hvd.init()
    horovod_threads = _thread_ids() - threads_before
    if watchdog is not None:
        watchdog.rank = hvd.rank()
        watchdog.arm("pinning devices")
    # On a CPU rank under MPI (or alone), Horovod's threads yield the cores to the compute.
    on_gpu = bool(use_gpu and tf.config.list_physical_devices("GPU"))
    if not on_gpu and (hvd.size() == 1 or hvd.mpi_enabled()):
        _yield_to_compute(horovod_threads)
    rank, local_rank, local_size = hvd.rank(), hvd.local_rank(), hvd.local_size()
    if elastic:
        # Horovod numbers local ranks per host *name*, and an elastic job may list one machine
        # under several names with one slot each (launch/discover_hosts.sh), where every worker
        # has local rank 0. Pin by a slot unique on the machine instead. The number of workers on
        # the machine changes during the job and no worker knows its future maximum, so on a CPU
        # the cores are split by the slots known at start-up: best effort, shares may overlap
        # (slot 0, alone at first, keeps every core).
        local_rank = _machine_slot()
        local_size = max(local_size, local_rank + 1)

    # Pin: each process sees exactly one GPU, the one at its local rank, so it neither computes on
    # nor reserves memory of its neighbours' GPUs; memory growth lets it take only what it needs.
    error = None
    gpus = tf.config.list_physical_devices("GPU") if use_gpu else []
    if gpus and local_size > len(gpus):
        error = HvdtrainError(
            f"{local_size} ranks on this host but only {len(gpus)} visible GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}): start at most "
            f"one rank per GPU, or pass --cpu to train on the CPU"
        )
    if gpus and error is None:
        gpu = gpus[local_rank]
        tf.config.set_visible_devices([gpu], "GPU")
        tf.config.experimental.set_memory_growth(gpu, True)
        device = "/GPU:0"
    else:
        tf.config.set_visible_devices([], "GPU")
        device = "/CPU:0"

    # CPU threads: ranks on one machine split the cores they may all run on instead of each
    # starting a thread per core, which would oversubscribe the machine local_size times over; a
    # rank its launcher bound to cores of its own keeps those. The ranks compare their bindings
    # to decide (one allgather), but TensorFlow's thread pools are sized before that collective
    # starts its runtime: by the share this rank expects.
    own = frozenset(os.sched_getaffinity(0))
    expected = _expected_share(own, _launch_cores(), local_size)
    intra = threads if threads > 0 else expected
    tf.config.threading.set_intra_op_parallelism_threads(intra)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    if elastic:
        # No collective here: a worker joining an elastic job starts up alone (see DistContext.agree).
        cores = _slice(own, local_rank, local_size, {cpu: _topology(cpu) for cpu in own})
    else:
        cores = _agreed_cpu_share(hvd, rank, own, intra, threads_given=threads > 0)
    if len(cores) < len(own):
        # Every thread of the rank is confined to its share, Horovod's background loop included,
        # so no rank computes or polls on another rank's cores. A user's HOROVOD_THREAD_AFFINITY
        # makes Horovod place its background thread: leave it there. MPI's helpers, started
        # before Horovod places it, keep the process's cores and are pinned with the rest.
        _pin_threads(cores, skip=_placed_elsewhere(horovod_threads))

    ctx = DistContext(
        rank=rank,
        local_rank=local_rank,
        size=hvd.size(),
        local_size=local_size,
        cross_size=hvd.cross_size(),
        device=device,
        cpu_cores=cores,
        intra_op_threads=intra,
        elastic_startup=elastic,
        horovod_threads=frozenset(horovod_threads),
    )
    ctx.agree(error, "pinning devices")
    return ctx
