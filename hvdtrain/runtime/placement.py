"""Where a rank's threads run on a CPU host: topology, the ranks' agreed shares of cores, pinning.

Ranks on one machine that may run on the same CPUs split them into equal slices of whole physical
cores; a rank its launcher bound to CPUs of its own keeps them; ranks whose bindings overlap get
disjoint parts of them where that is possible (:func:`cpu_shares`). Every rank computes the whole
machine's assignment from every rank's binding and topology (one allgather,
:func:`agreed_cpu_share`), so the ranks agree without further messages. :func:`pin_threads` then
confines every thread of the process to the rank's share, those Horovod started included under MPI
(under Gloo they wait in the kernel, and keep the launch's cores: ``hvdtrain.runtime.dist``).

Pure functions of bindings and topologies, except where a docstring names the process or Horovod,
and :func:`machine_slot`, an elastic worker's slot (its GPU, its CPU slice) on the machine.
"""
from __future__ import annotations

import contextlib
import os
import socket
import sys
from typing import Callable, Sequence

from hvdtrain.errors import HvdtrainError
from hvdtrain.console import say

def machine_id() -> str:
    """This machine's identity, whatever the hostname says: the kernel's boot id (containers on one
    machine share it, and its cores), or the hostname where the boot id cannot be read."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def launch_cpus() -> frozenset:
    """The CPUs this process's parent may run on: those of the launcher or its daemon (``mpirun``,
    ``orted``, ``slurmstepd``, ``horovodrun``), which a launcher's binding of this process narrows;
    this process's own where the parent's cannot be read. (A wrapper between launcher and rank,
    ``mpirun ... bash wrap.sh``, has the rank's binding: :func:`expected_share` then guesses.)"""
    try:
        return frozenset(os.sched_getaffinity(os.getppid()))
    except OSError:
        return frozenset(os.sched_getaffinity(0))


def parse_cpu_list(text: str) -> frozenset:
    """The CPUs of a Linux CPU list such as ``0-3,8,10-11`` (sysfs format)."""
    cpus = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


def cpu_topology(cpu: int) -> tuple:
    """``(socket, first CPU of its physical core)`` of logical CPU ``cpu``, from sysfs: CPUs with
    the same answer are hyperthreads of one core. ``(0, cpu)`` where sysfs does not say."""
    base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
    try:
        with open(f"{base}/physical_package_id") as f, open(f"{base}/thread_siblings_list") as g:
            return int(f.read()), min(parse_cpu_list(g.read()) | {cpu})
    except (OSError, ValueError):
        return 0, cpu


def physical_cores(cpus, topology) -> list:
    """``cpus`` grouped by physical core (hyperthreads together), in socket and core order.

    Args:
        cpus: logical CPU ids (ints).
        topology: :func:`cpu_topology`'s answer for each of them (a mapping).

    Returns:
        Lists of ints, one per physical core.
    """
    cores = {}
    for cpu in sorted(cpus, key=lambda c: (*topology[c], c)):
        cores.setdefault(topology[cpu], []).append(cpu)
    return list(cores.values())


def cpu_slice(cpus, index: int, count: int, topology) -> tuple:
    """Slice ``index`` of ``count`` equal contiguous slices of ``cpus``: of whole physical cores
    where they divide evenly among the ``count``, else of logical CPUs in core order (a core's
    hyperthreads adjacent, so at most the cores at the slices' edges are split); all of ``cpus``
    when there are fewer than ``count`` (oversubscribed).

    Args:
        cpus: logical CPU ids (ints).
        index: which slice, in ``[0, count)``.
        count: the number of slices.
        topology: :func:`cpu_topology`'s answer for every one of ``cpus`` (a mapping).

    Returns:
        The slice's CPUs (ints, ascending).
    """
    cores = physical_cores(cpus, topology)
    if len(cores) % count == 0:
        per_rank = len(cores) // count
        return tuple(sorted(cpu for core in cores[index * per_rank:(index + 1) * per_rank] for cpu in core))
    flat = [cpu for core in cores for cpu in core]
    if count > len(flat):
        return tuple(sorted(flat))
    per_rank = len(flat) // count
    return tuple(sorted(flat[index * per_rank:(index + 1) * per_rank]))


def overlap_groups(bindings) -> list:
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


def share_overlapping(bindings, topology) -> list:
    """Disjoint parts of bindings that overlap without being the same (one group of
    :func:`overlap_groups`).

    First one CPU for every rank wherever the bindings allow that (a maximum bipartite matching
    by augmenting paths: Kuhn 1955, "The Hungarian method for the assignment problem"), the most
    narrowly bound rank first; then, in turns, one free CPU of its binding at a time to each rank
    with fewer than an equal part of the group's CPUs, preferring a hyperthread of a core it
    holds, then a CPU that fewer other bindings contain (so a widely bound rank leaves a narrowly
    bound one its CPUs); then every CPU still free to the rank, among those bound to it, that
    holds the fewest. A rank left without a CPU shares its binding's least used one.

    Args:
        bindings: the CPUs (frozensets of ints) each rank of the group may run on, in rank order.
        topology: :func:`cpu_topology`'s answer for every one of those CPUs (a mapping).

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


def cpu_shares(bindings: Sequence, topology) -> tuple:
    """The CPUs each rank on one machine should use: CPUs of its own where there are enough.

    Ranks whose launcher let them run on the same CPUs (all of a host's, a container's cpuset, a
    ``taskset`` around the launcher, or one socket that ``mpirun --bind-to socket`` bound several
    ranks to) split them into equal slices (:func:`cpu_slice`), in rank order. A rank whose binding
    no other rank shares (``mpirun --bind-to core``, ``--map-by slot:PE=4``, ``srun
    --cpu-bind=cores``) keeps it. Ranks whose bindings overlap without being the same get
    disjoint parts of them where that is possible (:func:`share_overlapping`).

    Args:
        bindings: the CPUs (sets of ints) that each rank on this machine may run on, in rank order.
        topology: :func:`cpu_topology`'s answer for every one of those CPUs (a mapping).

    Returns:
        ``(shares, overlapping)``: each rank's CPUs (tuples of ints, ascending), in the order of
        ``bindings``, and the indices of the ranks whose bindings overlap without being the same.
    """
    bindings = [frozenset(cpus) for cpus in bindings]
    shares, overlapping = [()] * len(bindings), []
    for group in overlap_groups(bindings):
        if len({bindings[i] for i in group}) == 1:
            for k, i in enumerate(group):
                shares[i] = cpu_slice(bindings[i], k, len(group), topology)
        else:
            for i, share in zip(group, share_overlapping([bindings[i] for i in group], topology)):
                shares[i] = share
            overlapping += group
    return tuple(shares), sorted(overlapping)


def expected_share(own, launch_cpus, local_size: int) -> int:
    """How many CPUs this rank will likely get (:func:`cpu_shares`; the CPUs per rank, when
    oversubscribed), before the ranks compare their bindings: TensorFlow's thread pools are sized
    before its runtime starts, and the comparison is a collective, which starts it. Ranks are
    taken to share this rank's binding in proportion to its part of the launcher's CPUs: all
    local ranks when unbound, only this one when bound to a ``local_size``-th or less.

    Args:
        own: the CPUs this process may run on.
        launch_cpus: the CPUs its launcher may run on (:func:`launch_cpus`).
        local_size: the number of ranks on this host.

    Returns:
        The number of CPUs, at least 1.
    """
    universe = len(frozenset(launch_cpus) | frozenset(own))
    sharing = min(local_size, max(1, -(-local_size * len(own) // universe)))  # ceil
    return max(1, len(own) // sharing)


def agreed_cpu_share(allgather: Callable[[object], list], world_size: int, rank: int, own, intra: int,
                     threads_given: bool) -> tuple:
    """This rank's CPUs (:func:`cpu_shares`), from every rank's machine, binding and topology,
    which the ranks exchange (an allgather; every rank must call it at the same point), so that
    every rank computes the same assignment.

    Rank 0 prints one warning naming the ranks whose bindings overlap without being the same,
    and, unless the user set the thread pools' size (``--threads``), one naming the ranks whose
    pool (sized before the exchange) is not one thread per CPU they got.

    Args:
        allgather: returns the list, in rank order, of every rank's argument (a collective:
            :meth:`hvdtrain.runtime.dist.DistContext.allgather_object`).
        world_size: the number of ranks.
        rank: this process's rank.
        own: the CPUs this process may run on.
        intra: the size of this rank's TensorFlow intra-op thread pool.
        threads_given: whether the user set that size.

    Returns:
        The CPUs (ints, ascending).

    Raises:
        horovod.common.exceptions.HorovodInternalError: if the allgather fails (a rank lost).
    """
    topology = {cpu: cpu_topology(cpu) for cpu in own}
    if world_size == 1:
        return cpu_slice(own, 0, 1, topology)
    everyone = allgather((machine_id(), sorted(own), intra, topology))
    shares, per_rank, overlapping = [()] * len(everyone), [1] * len(everyone), []
    for machine in dict.fromkeys(m for m, _, _, _ in everyone):
        on_machine = [r for r, (m, _, _, _) in enumerate(everyone) if m == machine]
        known = {cpu: tuple(where) for r in on_machine for cpu, where in everyone[r][3].items()}
        machine_shares, overlap = cpu_shares([everyone[r][1] for r in on_machine], known)
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


def thread_ids() -> set:
    return {int(t) for t in os.listdir("/proc/self/task")} if os.path.isdir("/proc/self/task") else set()


def placed_elsewhere(thread_ids) -> set:
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


def pin_threads(cores, skip=()) -> None:
    """Confine every thread of this process, not only the calling one, to ``cores``.

    ``sched_setaffinity`` binds one thread, and threads started before it keep their affinity:
    Horovod's background loop and MPI's helpers (started by ``hvd.init``) and TensorFlow's
    early threads would otherwise run on every core of the host, the other ranks' included.
    Threads started later inherit the affinity of the thread that starts them.

    Args:
        cores: the CPU cores (ints).
        skip: thread ids to leave as they are.
    """
    for tid in (thread_ids() or {0}) - set(skip):
        try:
            os.sched_setaffinity(tid, cores)
        except ProcessLookupError:  # the thread has exited meanwhile
            pass


@contextlib.contextmanager
def threads_started_on(cores):
    """Threads the calling thread starts inside the block may run on ``cores`` (a new thread
    inherits its starter's affinity); the calling thread's own affinity is restored after."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


_SLOT_LOCKS: list = []  # open lock files, held for the life of the process


def machine_slot(max_slots: int = 256) -> int:
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
