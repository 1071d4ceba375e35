"""Distributed state: Horovod start-up, device and thread pinning, and rank coordination.

Everything that asks Horovod "who am I?", "how many are we?" or makes a collective outside the
compiled training step lives here. The rest of hvdtrain receives one :class:`DistContext`
explicitly instead of calling ``hvd.rank()`` wherever it likes, so that which code runs on which
rank can be read off the call sites. (The compiled step's gradient allreduce is Horovod's
``DistributedOptimizer``, and synchronized BatchNorm's are the layer's own.)
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from typing import Callable, Optional, Sequence, TypeVar

import numpy as np

from hvdtrain.errors import EveryRankError, FoundHere, HvdtrainError, PeerFailure
from hvdtrain.console import say
from hvdtrain.runtime import placement, priority
from hvdtrain.runtime.determinism import make_deterministic
from hvdtrain.runtime.devices import check_started_devices, runtime_started
from hvdtrain.runtime.launcher import launcher_rank

T = TypeVar("T")


def current_rank() -> int:
    """This process's rank now: Horovod's while it runs (an elastic reset renumbers the workers, and
    the worker the launcher started as rank 0 may be gone), else :func:`launcher_rank`."""
    hvd = sys.modules.get("horovod.tensorflow")
    if hvd is not None and hvd.is_initialized():
        return hvd.rank()
    return launcher_rank()


_collective: Optional[str] = None  # the collective the main thread is in, if any


@contextlib.contextmanager
def in_collective(name: str):
    """Mark the enclosed code as waiting in the collective ``name`` (the watchdog reports it if the
    job stalls: :mod:`hvdtrain.runtime.watchdog`)."""
    global _collective
    outer, _collective = _collective, name
    try:
        yield
    finally:
        _collective = outer


def current_collective() -> Optional[str]:
    """The collective the main thread waits in now (:func:`in_collective`), or None."""
    return _collective


def broadcast_object(obj, root_rank: int = 0, name: Optional[str] = None):
    """``root_rank``'s picklable ``obj`` on every rank of the job Horovod runs now (a collective):
    for Horovod's elastic state, which outlives a :class:`DistContext` across resets."""
    import horovod.tensorflow as hvd

    return hvd.broadcast_object(obj, root_rank=root_rank, name=name)


def broadcast_variables(variables, root_rank: int = 0) -> None:
    """Overwrite ``variables`` (TensorFlow variables, or Keras 3's, the same list on every rank)
    with ``root_rank``'s values on every rank of the job Horovod runs now (a collective)."""
    import horovod.tensorflow as hvd

    hvd.broadcast_variables([tf_variable(v) for v in variables], root_rank=root_rank)


def tf_variable(variable):
    """The ``tf.Variable`` that holds a Keras 3 variable, or ``variable``. Its ``_value``, not
    ``value``: that is a cast tensor inside a layer's autocast scope."""
    import tensorflow as tf

    if isinstance(variable, tf.Variable):
        return variable
    held = getattr(variable, "_value", None)
    return held if isinstance(held, tf.Variable) else getattr(variable, "value", variable)


def restart_horovod(ctx: "DistContext") -> None:
    """Shut Horovod down and start it again with the workers its elastic driver has now (an
    elastic reset); :meth:`DistContext.refreshed` then tells who this process is. Horovod's new
    threads start on ``ctx.launch_cores``, as at start-up under Gloo (:func:`init_distributed`),
    not on the rank's cores that the calling thread is pinned to."""
    import horovod.tensorflow as hvd

    hvd.shutdown()
    with placement.threads_started_on(ctx.launch_cores or ctx.cpu_cores):
        hvd.init()


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
        cpu_cores: the CPU cores every thread of this process is pinned to
            (:func:`hvdtrain.runtime.placement.cpu_shares`), but Horovod's under Gloo, which keep
            ``launch_cores``.
        intra_op_threads: TensorFlow intra-op thread-pool size.
        elastic_startup: an elastic worker starting up, before its first state sync: it may
            start alone while the others wait in that sync, so :meth:`agree` runs no collective.
            :meth:`refreshed` (after the sync) clears it.
        horovod_threads: ids of the threads ``hvd.init`` started in this process (Horovod's
            background loop, MPI's or Gloo's helpers), for diagnostics such as
            ``benchmarks/thread_time.py``. Not updated after an elastic reset, when Horovod
            restarts its threads (on ``launch_cores``: :func:`restart_horovod`).
        launch_cores: the CPU cores the process was launched on (its affinity at start-up).
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
    launch_cores: tuple = ()

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

    def allgather_object(self, obj, name: str) -> list:
        """Every rank's picklable ``obj``, in rank order (a collective)."""
        if self.size == 1:
            return [obj]
        import horovod.tensorflow as hvd

        with in_collective(f"allgather {name}"):
            return hvd.allgather_object(obj, name=name)

    def broadcast_variables(self, variables, name: str = "the broadcast of the variables") -> None:
        """Overwrite ``variables`` (TensorFlow's or Keras 3's, the same list on every rank) with rank 0's
        values (a collective): initial weights differ per rank, and after a resume only rank 0 has
        restored them."""
        if self.size == 1:
            return
        with in_collective(name):
            broadcast_variables(variables)

    def agree(self, error: Optional[BaseException], what: str) -> None:
        """Make every rank fail together if any rank hit an error during ``what``.

        A collective: every rank must call it at the same point. Ranks that are fine would otherwise
        wait forever in the next collective for a rank that has died or is about to raise.

        Args:
            error: the exception this rank caught during ``what``, or None.
            what: a short description for the message, e.g. ``"loading data"``.

        Raises:
            FoundHere: holding the rank's own ``error``, on the lowest failing rank (which prints
                it), and :class:`PeerFailure` on every other rank, whenever any rank passed an error.
        """
        if self.elastic_startup:
            # A worker that joins an elastic job later runs start-up alone while the others wait
            # in the state sync: a collective here would pair with theirs and deadlock. Each
            # worker checks its own start-up; one that fails leaves, and the job goes on without it.
            if error is not None:
                raise FoundHere(error) from error
            return
        flags = self.allreduce_sum(
            [1.0 if r == self.rank and error is not None else 0.0 for r in range(self.size)],
            name=f"hvdtrain.agree.{what.replace(' ', '_')}",
        )
        failing = np.flatnonzero(flags)
        if failing.size == 0:
            return
        if self.rank == failing[0]:
            raise FoundHere(error) from error
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


def init_distributed(threads: int = 0, use_gpu: bool = True, stall_timeout: float = 0.0,
                     elastic: bool = False, watchdog=None, horovod_nice: int = 19,
                     horovod_cycle_time_ms: float = 0.1, deterministic: bool = False) -> DistContext:
    """Start Horovod and pin this process to its own GPU (or its own CPU cores).

    Best called before any TensorFlow op: device visibility and thread pools are fixed once
    TensorFlow's runtime starts. Called later (a script that built its optimizer first), a CPU
    rank keeps the runtime's thread pools, its threads still pinned to the rank's cores, and a GPU
    rank goes on if the runtime already sees only its GPU. Calling it again (``hvdtrain.fit``
    after a script's own call) pins nothing anew; settings that Horovod reads once at start-up
    (``deterministic``) must be given to the first call.

    Args:
        threads: TensorFlow intra-op threads; 0 = one per core this rank expects to get (see
            :func:`hvdtrain.runtime.placement.expected_share`; rank 0 warns of ranks that got
            another number).
        use_gpu: use the GPU at the local rank if the host has GPUs; False forces the CPU.
        stall_timeout: the watchdog's timeout, seconds (:mod:`hvdtrain.runtime.watchdog`): Horovod's
            stall inspector reports missing ranks after half of it; 0 leaves Horovod's default.
        elastic: the process was started by Horovod's elastic driver (see :mod:`hvdtrain.elastic`).
        watchdog: a :class:`hvdtrain.runtime.watchdog.Watchdog` to arm as soon as ``hvd.init()``
            returns, so that a rank wedged while pinning (a faulted GPU's query, say) ends the job
            instead of leaving the others in the pinning collective. Not before: ``hvd.init()``
            waits for every rank to start, which may take long on a cluster.
        horovod_nice: the nice level of Horovod's threads on a CPU rank under MPI or alone
            (:func:`hvdtrain.runtime.priority.yield_to_compute`); 0 leaves them be.
        horovod_cycle_time_ms: ``HOROVOD_CYCLE_TIME`` unless the environment sets it: how often
            Horovod's background thread looks for ready collectives, milliseconds.
        deterministic: make every collective and op deterministic (see below), for bit-identical
            runs at any world size.

    Returns:
        The :class:`DistContext` for this process.

    Raises:
        EveryRankError: with ``elastic`` but no elastic launcher (``HOROVOD_ELASTIC`` unset).
        FoundHere: holding an HvdtrainError, if a host has GPUs but fewer than its local ranks (two
            ranks sharing one GPU is the "all memory grabbed, one GPU computing" pitfall), or if
            TensorFlow's runtime started before this call holding other GPUs than this rank's, on
            the lowest such rank, which prints it; the other ranks raise :class:`PeerFailure`.
    """
    import horovod.tensorflow as hvd
    import tensorflow as tf

    # Horovod's background thread looks for ready collectives once per cycle (default 1 ms); each
    # synchronized BatchNorm layer waits for two small allreduces per step, so a shorter cycle
    # pays that latency less often. A user's own setting wins.
    os.environ.setdefault("HOROVOD_CYCLE_TIME", f"{horovod_cycle_time_ms:g}")
    # Each group (a gradient bucket, a BatchNorm's statistics) is fused alone, never with what else
    # happens to be ready: the same buffers every step, so the same sums (hvdtrain.exchange).
    os.environ.setdefault("HOROVOD_DISABLE_GROUP_FUSION", "1")
    if deterministic:
        make_deterministic()
    if stall_timeout > 0:  # Horovod's own report of missing ranks, while its coordinator can still run
        os.environ.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", str(max(1, int(stall_timeout // 2))))
    if elastic:
        if os.environ.get("HOROVOD_ELASTIC") != "1":
            raise EveryRankError("--elastic: this process was not started by an elastic launcher; use horovodrun "
                                "with --min-np/--max-np and --host-discovery-script (see launch/elastic.sh)")
        # Horovod's response cache lets ranks skip negotiating tensors they all saw before. A
        # worker that survived a reset keeps entries a joining worker lacks: here the first step
        # after a worker joined aborted the survivor (Gloo "op.preamble.length <= op.nbytes",
        # fused buffers of different sizes) until the cache was off. A user's setting wins.
        os.environ.setdefault("HOROVOD_CACHE_CAPACITY", "0")

    # Init: starts the background thread that negotiates and runs collectives (Gloo or MPI).
    threads_before = placement.thread_ids()
    hvd.init()
    horovod_threads = placement.thread_ids() - threads_before
    if watchdog is not None:
        watchdog.arm("pinning devices")
    # On a CPU rank under MPI (or alone), Horovod's threads yield the cores to the compute.
    on_gpu = bool(use_gpu and tf.config.list_physical_devices("GPU"))
    if not on_gpu and (hvd.size() == 1 or hvd.mpi_enabled()):
        priority.yield_to_compute(horovod_threads, horovod_nice)
    rank, local_rank, local_size = hvd.rank(), hvd.local_rank(), hvd.local_size()
    if elastic:
        # Horovod numbers local ranks per host *name*, and an elastic job may list one machine
        # under several names with one slot each (launch/discover_hosts.sh), where every worker
        # has local rank 0. Pin by a slot unique on the machine instead. The number of workers on
        # the machine changes during the job and no worker knows its future maximum, so on a CPU
        # the cores are split by the slots known at start-up: best effort, shares may overlap
        # (slot 0, alone at first, keeps every core).
        local_rank = placement.machine_slot()
        local_size = max(local_size, local_rank + 1)

    # Pin: each process sees exactly one GPU, the one at its local rank, so it neither computes on
    # nor reserves memory of its neighbours' GPUs; memory growth lets it take only what it needs.
    # Where the user's script started TensorFlow's runtime first (an op, a variable, a Keras
    # optimizer), the devices it sees are fixed: fine if they are already this rank's alone.
    started = runtime_started()
    error = None
    gpus = tf.config.list_physical_devices("GPU") if use_gpu else []
    if gpus and local_size > len(gpus):
        error = HvdtrainError(
            f"{local_size} ranks on this host but only {len(gpus)} visible GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}): start at most "
            f"one rank per GPU, or pass --cpu to train on the CPU"
        )
    elif started:
        error = check_started_devices(gpus[local_rank:local_rank + 1] if gpus else [])
    elif gpus:
        tf.config.set_visible_devices([gpus[local_rank]], "GPU")
        tf.config.experimental.set_memory_growth(gpus[local_rank], True)
    else:
        tf.config.set_visible_devices([], "GPU")
    device = "/GPU:0" if gpus and error is None else "/CPU:0"

    # CPU threads: ranks on one machine split the cores they may all run on instead of each
    # starting a thread per core, which would oversubscribe the machine local_size times over; a
    # rank its launcher bound to cores of its own keeps those. The ranks compare their bindings
    # to decide (one allgather), but TensorFlow's thread pools are sized before that collective
    # starts its runtime: by the share this rank expects. A runtime the user's script started
    # keeps its pools; pinning below still confines their threads to the rank's cores.
    own = frozenset(os.sched_getaffinity(0))
    expected = placement.expected_share(own, placement.launch_cpus(), local_size)
    intra = threads if threads > 0 else expected
    if started:
        intra = tf.config.threading.get_intra_op_parallelism_threads() or len(own)
    else:
        tf.config.threading.set_intra_op_parallelism_threads(intra)
        tf.config.threading.set_inter_op_parallelism_threads(2)
    if elastic:
        # No collective here: a worker joining an elastic job starts up alone (see DistContext.agree).
        cores = placement.cpu_slice(own, local_rank, local_size, {cpu: placement.cpu_topology(cpu) for cpu in own})
    else:
        def allgather(binding):
            with in_collective("comparing the ranks' CPU bindings (allgather)"):
                return hvd.allgather_object(binding, name="hvdtrain.cpu_bindings")

        cores = placement.agreed_cpu_share(allgather, hvd.size(), rank, own, intra,
                                           threads_given=threads > 0 or started)
    if started and rank == 0 and intra > len(cores):
        say(f"hvdtrain: note: TensorFlow's runtime started before hvdtrain.init_distributed(), with {intra} intra-op "
            f"threads per rank for its {len(cores)} core(s) (they share them); call hvdtrain.init_distributed() "
            f"first in your script for a pool of the rank's size", sys.stderr)
    if len(cores) < len(own):
        # The rank's threads are confined to its share, so that no rank computes on another's
        # cores; under MPI, Horovod's background loop too, since it busy-polls. Under Gloo,
        # Horovod's threads (its loop, Gloo's transport) keep the cores the rank was launched on:
        # they wait in the kernel between a collective's messages, and confined to the compute's
        # core each hand-off waited for the scheduler (np=2 on 2 cores: a chained allreduce
        # 4.7 ms instead of 0.65, MobileNetV2's synchronized BatchNorm 5x slower; benchmarks/
        # chained_allreduce.py). The reductions they run are small; the cycle's wake-ups cheap.
        # Under MPI, a user's HOROVOD_THREAD_AFFINITY makes Horovod place its background thread:
        # leave it there. MPI's helpers, started before Horovod places it, keep the process's
        # cores and are pinned with the rest.
        left = set(horovod_threads) if hvd.gloo_enabled() else placement.placed_elsewhere(horovod_threads)
        placement.pin_threads(cores, skip=left)

    ctx = DistContext(
        rank=rank,
        local_rank=local_rank,
        size=hvd.size(),
        local_size=local_size,
        cross_size=hvd.cross_size(),
        device=device,
        cpu_cores=cores,
        launch_cores=tuple(sorted(own)),
        intra_op_threads=intra,
        elastic_startup=elastic,
        horovod_threads=frozenset(horovod_threads),
    )
    ctx.agree(error, "pinning devices")
    return ctx
