"""Shared by the benchmark scripts: launching ranks, timing statistics, memory, tables and plots.

A benchmark script is both the *driver* (run once by the user: launches jobs, alternates variants,
prints the table, writes the plot) and, with ``--worker``, the *worker* that every rank of a
launched job runs. Workers hand their figures back through a JSON file written by rank 0.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
FASHION_MNIST = "/usr/share/datasets/fashion-mnist"
# The Horovod synthetic benchmark's method: warm-up batches excluded, then timed iterations of
# several batches each; throughput = mean over iterations +- 1.96 standard deviations of the
# iterations (Horovod's "conf": the range holding ~95% of iterations, not an interval of the mean).
Z95 = 1.96


def mean_ci(samples: Sequence[float]) -> tuple:
    """``(mean, 1.96 standard deviations)`` of per-iteration samples, as Horovod's
    ``tensorflow2_synthetic_benchmark.py`` reports them (the range of ~95% of the iterations)."""
    x = np.asarray(samples, dtype=np.float64)
    return float(x.mean()), float(Z95 * x.std())


def images_per_second(run, batch_size: int, warmup_batches: int, iters: int, batches_per_iter: int) -> List[float]:
    """Per-iteration images/s of ``run(n)`` (n training steps of ``batch_size`` images, waiting for
    the last), after ``warmup_batches`` untimed steps (tracing, allocation). In a job started by
    :func:`run_jobs_at_once` beside others, the timed iterations are lined up with theirs
    (:class:`SideBySide`)."""
    run(warmup_batches)
    side_by_side = SideBySide.from_env()
    side_by_side.start()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        run(batches_per_iter)
        samples.append(batch_size * batches_per_iter / (time.perf_counter() - start))
    side_by_side.finish(keep_busy=lambda: run(1))
    return samples


class SideBySide:
    """Lines up the timed part of jobs that :func:`run_jobs_at_once` started together, so that
    each one is timed only while all of them run: every job waits until all have warmed up
    before timing (each starts up, loads data and traces at its own pace), and one that is done
    first keeps running untimed steps until all are done (else the last would finish alone).

    The jobs are single processes (the ranks of a job would have to agree on the untimed steps);
    they meet through files in the directory named by ``$HVDTRAIN_BENCH_SIDE_BY_SIDE``
    (``<directory>:<number of jobs>``). Without it (a job run alone) every method does nothing.
    """
    ENV = "HVDTRAIN_BENCH_SIDE_BY_SIDE"

    def __init__(self, directory: Optional[str], jobs: int, timeout: float = 600):
        self.directory, self.jobs, self.timeout = directory, jobs, timeout

    @classmethod
    def from_env(cls) -> "SideBySide":
        directory, _, jobs = os.environ.get(cls.ENV, "").rpartition(":")
        return cls(directory or None, int(jobs) if directory else 0)

    def _arrive(self, stage: str) -> None:
        Path(self.directory, f"{stage}-{os.getpid()}").touch()

    def _count(self, stage: str) -> int:
        return len(list(Path(self.directory).glob(f"{stage}-*")))

    def start(self) -> None:
        """Wait until every job has arrived here (after its warm-up).

        Raises:
            SystemExit: if they have not after ``timeout`` seconds (a job failed).
        """
        if not self.directory:
            return
        self._arrive("ready")
        deadline = time.monotonic() + self.timeout
        while self._count("ready") < self.jobs:
            if time.monotonic() > deadline:
                raise SystemExit(f"side-by-side jobs: only {self._count('ready')} of {self.jobs} "
                                 f"warmed up within {self.timeout:.0f} s")
            time.sleep(0.01)

    def finish(self, keep_busy) -> None:
        """Call ``keep_busy()`` (an untimed step) until every job has finished its timed part."""
        if not self.directory:
            return
        self._arrive("done")
        deadline = time.monotonic() + self.timeout
        while self._count("done") < self.jobs and time.monotonic() < deadline:
            keep_busy()


def median_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """The ratio of two variants measured side by side in each of several rounds (or repeats),
    paired by round, so that a slow spell of the machine, which hits both sides of one round,
    cancels out of that round's ratio. (The ratio of the two medians would compare figures from
    different rounds.)

    Args:
        numerators: one figure per round (seconds, images/s: any unit, the same in both).
        denominators: the other variant's figure in the same rounds, in the same order.

    Returns:
        The median over rounds of ``numerators[i] / denominators[i]``.

    Raises:
        ValueError: if the sequences are empty or differ in length.
    """
    if not numerators or len(numerators) != len(denominators):
        raise ValueError(f"median_ratio needs pairs: got {len(numerators)} numerators and "
                         f"{len(denominators)} denominators")
    return statistics.median(n / d for n, d in zip(numerators, denominators))


class StepTimes:
    """Seconds per step of each variant in each alternating round (mean over ranks), from
    :func:`alternating_step_times`. Methods taking a variant name raise ``KeyError`` for one that
    was not timed.

    Attributes:
        samples: ``{variant: [seconds per step in round 0, round 1, ...]}``, variants in the order
            of the ``runs`` given (every other round ran them in reverse).
    """

    def __init__(self, samples: Dict[str, List[float]]):
        self.samples = samples

    def median(self, name: str) -> float:
        """The variant's median seconds per step over the rounds."""
        return statistics.median(self.samples[name])

    def medians(self) -> Dict[str, float]:
        """``{variant: median seconds per step}``, in the order of :attr:`samples`."""
        return {name: self.median(name) for name in self.samples}

    def ratio(self, name: str, other: str) -> float:
        """``name``'s step time over ``other``'s: the median of the per-round ratios
        (:func:`median_ratio`)."""
        return median_ratio(self.samples[name], self.samples[other])


def alternating_step_times(ctx, runs: dict, warmup: int, rounds: int, steps: int) -> StepTimes:
    """Seconds per step of each ``runs[name](n)`` (n steps, waiting for the last), timed in
    alternating rounds so that machine noise hits every variant alike. Every other round runs the
    variants in reverse order (A B, B A, ...), so that running first or last in a round (a warm or
    a cold cache, a pending allreduce) does not favour one variant.

    Args:
        ctx: the ranks' :class:`hvdtrain.runtime.dist.DistContext`.
        runs: ``{variant: run}``, ``run(n)`` taking n steps and waiting for the last.
        warmup: untimed steps of each variant first (tracing, allocation).
        rounds: alternating rounds; steps: steps of each variant per round.

    Returns:
        :class:`StepTimes`: every round's seconds per step per variant, each the mean over ranks
        (ranks wait for each other, so they agree closely). A collective: one allreduce of
        ``rounds * len(runs)`` numbers.
    """
    for run in runs.values():
        run(warmup)  # tracing and allocation, untimed
    samples = {name: [] for name in runs}
    for round_ in range(rounds):
        for name, run in (list(runs.items()) if round_ % 2 == 0 else list(runs.items())[::-1]):
            start = time.perf_counter()
            run(steps)
            samples[name].append((time.perf_counter() - start) / steps)
    mean = ctx.allreduce_sum([t for name in runs for t in samples[name]], "bench.step_times") / ctx.size
    return StepTimes({name: mean[i * rounds:(i + 1) * rounds].tolist() for i, name in enumerate(runs)})


_HOROVOD_BN_IDS = itertools.count()


def _horovod_sync_bn_layer():
    """Horovod's ``hvd.SyncBatchNormalization`` (momentum 0.9), uniquely named: Horovod's layer
    names itself identically unless told otherwise, which breaks a second one in a model."""
    import horovod.tensorflow as hvd

    return hvd.SyncBatchNormalization(momentum=0.9, name=f"hvd_sync_bn_{next(_HOROVOD_BN_IDS)}")


def keras_batch_norm(x, relu: bool = False):
    """The built-in models' ``norm`` (:data:`hvdtrain.model.zoo.Norm`) with Keras' ``BatchNormalization``
    (per rank, momentum 0.9) and a ReLU layer after it: what a plain Keras model has."""
    import tensorflow as tf
    from hvdtrain.model.zoo import unfused_norm

    return unfused_norm(lambda: tf.keras.layers.BatchNormalization(momentum=0.9))(x, relu=relu)


def horovod_sync_bn(x, relu: bool = False):
    """The built-in models' ``norm`` (:data:`hvdtrain.model.zoo.Norm`) with Horovod's layer; a ReLU layer after it."""
    from hvdtrain.model.zoo import unfused_norm

    return unfused_norm(_horovod_sync_bn_layer)(x, relu=relu)


def peak_rss_mib() -> float:
    """This process's peak resident memory so far, MiB (``getrusage`` ``ru_maxrss``, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def horovods_own_fusion() -> None:
    """Give this process Horovod's default ``HOROVOD_DISABLE_GROUP_FUSION=0`` (unless it is set);
    call before ``init_distributed``. hvdtrain's default ``1`` fuses each group alone and makes every
    plain collective a group of one, so a Horovod baseline in the same ranks would run unfused."""
    os.environ.setdefault("HOROVOD_DISABLE_GROUP_FUSION", "0")


def env_for_ranks(extra: Optional[dict] = None) -> dict:
    """Environment for launched ranks: this venv first on PATH, hvdtrain importable, CPU only.

    OpenMPI's shared memory copies in and out (``btl_vader_single_copy_mechanism=none``), because
    containers often forbid its default cross-memory attach, unless the caller's environment names
    a mechanism (``OMPI_MCA_btl_vader_single_copy_mechanism=cma`` measures what ``mpirun`` uses)."""
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "benchmarks"), env.get("PYTHONPATH", "")]),
        "PATH": os.pathsep.join([str(BIN), env.get("PATH", "")]),
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "PYTHONUNBUFFERED": "1",
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    })
    env.setdefault("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
    env.update(extra or {})
    return env


def launch_command(np_: int, argv: List[str], transport: str = "gloo") -> List[str]:
    """``np_`` ranks of ``python argv``: ``gloo`` (horovodrun --gloo), ``mpi`` (mpirun), or ``single``."""
    python = [sys.executable, *argv]
    if transport == "gloo":
        return [str(BIN / "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", "--gloo", *python]
    if transport == "mpi":
        return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-bind-to", "none", "-np", str(np_), *python]
    if transport == "single" and np_ == 1:
        return python
    raise ValueError(f"transport {transport!r} with np={np_}: expected gloo, mpi, or single with np=1")


def cores_for(np_: int) -> List[int]:
    """The first ``np_`` cores this process may use: on CPU, np ranks get np cores (one each)."""
    cores = sorted(os.sched_getaffinity(0))
    if np_ > len(cores):
        raise SystemExit(f"np={np_} needs {np_} cores (one per rank), this machine gives {len(cores)}")
    return cores[:np_]


def run_job(np_: int, script: str, args: List[str], transport: str = "gloo", cores: Optional[List[int]] = None,
            env: Optional[dict] = None, timeout: float = 1800, stream: bool = False) -> dict:
    """Run ``script --worker args`` on ``np_`` ranks and return rank 0's JSON result.

    ``cores`` restricts the whole job (launcher and ranks) to those CPU cores; hvdtrain's pinning
    then splits them among the local ranks. ``stream`` prints the job's standard output.

    Raises:
        SystemExit: with the job's output if it fails.
    """
    return run_jobs_at_once([(np_, cores)], script, args, transport, env, timeout, stream)[0]


def run_jobs_at_once(jobs: List[tuple], script: str, args: List[str], transport: str = "gloo",
                     env: Optional[dict] = None, timeout: float = 1800, stream: bool = False) -> List[dict]:
    """Run one job of ``script --worker args`` per ``(np, cores)`` in ``jobs``, all at the same
    time, and return each job's rank-0 JSON result in order (see :func:`run_job`).

    With ``[(1, [0]), (1, [1])]`` that is two copies of the np=1 job side by side, one per core,
    sharing nothing but the machine: the scaling a job without any communication reaches here.
    Jobs timed by :func:`images_per_second` are timed over the same span (:class:`SideBySide`).

    Raises:
        ValueError: for more than one job with np > 1.
        SystemExit: with the failed job's output if any job fails (the others are waited for
            first), or after ``timeout`` seconds. Every job's processes are killed if this
            function ends before they do (a timeout, Ctrl-C).
    """
    with tempfile.TemporaryDirectory() as tmp:
        extra = dict(env or {})
        if len(jobs) > 1:
            if any(np_ != 1 for np_, _ in jobs):
                raise ValueError(f"jobs run at once must be single processes (np=1), got {[np_ for np_, _ in jobs]}")
            extra[SideBySide.ENV] = f"{tmp}:{len(jobs)}"
        started = []
        try:
            for i, (np_, cores) in enumerate(jobs):
                out = os.path.join(tmp, f"result{i}.json")
                cmd = launch_command(np_, [script, "--worker", "--result", out, *args], transport)
                if cores is not None:
                    cmd = ["taskset", "-c", ",".join(map(str, cores)), *cmd]
                # Output into files, not pipes: a job must never block on a pipe that is read
                # only after another job has ended. Its own session, to kill its ranks with it.
                logs = [open(os.path.join(tmp, f"{stream_}{i}.txt"), "w") for stream_ in ("stdout", "stderr")]
                started.append((cmd, out, logs, subprocess.Popen(cmd, cwd=REPO, env=env_for_ranks(extra),
                                                                 stdout=logs[0], stderr=logs[1],
                                                                 start_new_session=True)))
            deadline = time.monotonic() + timeout
            for cmd, _, _, proc in started:
                try:
                    proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise SystemExit(f"benchmark job timed out after {timeout:.0f} s: {' '.join(cmd)}") from None
        finally:
            for _, _, logs, proc in started:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                for log in logs:
                    log.close()
        results = []
        for cmd, out, logs, proc in started:
            stdout, stderr = (Path(log.name).read_text() for log in logs)
            if proc.returncode != 0 or not os.path.exists(out):
                raise SystemExit(f"benchmark job failed ({' '.join(cmd)}), exit {proc.returncode}:\n"
                                 f"{stdout[-3000:]}\n{stderr[-5000:]}")
            if stream:
                print("\n".join(line.split("]<stdout>:", 1)[-1] for line in stdout.splitlines()), flush=True)
            with open(out) as f:
                results.append(json.load(f))
        return results


def gather_rss(ctx) -> List[float]:
    """Every rank's peak RSS in MiB, in rank order (a collective)."""
    rss = np.zeros(ctx.size)
    rss[ctx.rank] = peak_rss_mib()
    return ctx.allreduce_sum(rss, name="bench.rss").tolist()


def write_result(path: Optional[str], result: dict) -> None:
    """Rank 0 writes the worker's result for the driver."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f)


def print_table(headers: List[str], rows: List[List], title: str = "") -> str:
    """Print (and return) a Markdown table, after a blank line or ``title``, so it can be pasted
    into ``benchmarks/README.md``."""
    def cell(v):
        return f"{v:.3f}" if isinstance(v, float) and abs(v) < 10 else (f"{v:,.1f}" if isinstance(v, float) else str(v))

    # A blank line first, so that tables printed one after another stay apart.
    lines = ([f"\n{title}\n"] if title else [""]) + [
        "| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |",
        *("| " + " | ".join(cell(v) for v in row) + " |" for row in rows)]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def save_plot(fig, path: str) -> None:
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}", flush=True)


def matplotlib_pyplot():
    """pyplot on the headless Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def grouped_bars(path: str, groups: List[str], series: Dict[str, List[float]], ylabel: str, title: str,
                 target: Optional[float] = None) -> None:
    """Write a PNG of side-by-side bars: one group per entry of ``groups``, one bar per series in it,
    and a dashed line at ``target`` if given."""
    plt = matplotlib_pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        ax.bar([g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))], values, width, label=name)
    if target is not None:
        ax.axhline(target, color="black", linestyle="--", linewidth=1, label=f"target {target:g}")
    top = max([v for values in series.values() for v in values] + [target or 0])
    ax.set(xticks=list(range(len(groups))), xticklabels=groups, ylabel=ylabel, title=title, ylim=(0, 1.3 * top))
    ax.legend(loc="upper center", ncol=len(series) + (target is not None), fontsize="small")
    save_plot(fig, path)


def summary(samples: Dict[str, List[float]]) -> Dict[str, tuple]:
    return {k: mean_ci(v) for k, v in samples.items()}


# ---- hvdtrain's real training step, as the benchmarks time it --------------------------------------
IMAGE_SHAPES = {"cnn": (28, 28, 1), "resnet20": (32, 32, 3), "resnet50": (224, 224, 3)}


def bench_dataset(model: str, batch_size: int, world_size: int, real_data: bool = True):
    """The benchmark data of ``model``: real Fashion-MNIST for the seed CNN (when ``real_data``),
    else synthetic images of the model's input shape, a few global batches' worth."""
    from hvdtrain.data.in_memory import load_idx_dir, make_synthetic

    if model == "cnn" and real_data:
        return load_idx_dir(FASHION_MNIST)
    classes = 1000 if model == "resnet50" else 10
    return make_synthetic(num_train=batch_size * world_size * 8, num_test=10, image_shape=IMAGE_SHAPES[model],
                          num_classes=classes)


def build_bench_model(model: str, dataset, sync_bn: bool = True, norm=None):
    """The seed CNN (dropout kept), ResNet-20, or Keras' ResNet-50 (per-rank BN, logits out)."""
    import tensorflow as tf
    from hvdtrain.model.zoo import norm_factory, resnet20, seed_cnn

    norm = norm or norm_factory(sync_bn)
    if model == "cnn":
        return seed_cnn(dataset.input_shape, dataset.num_classes, norm=norm)
    if model == "resnet20":
        return resnet20(dataset.input_shape, dataset.num_classes, norm=norm)
    if model == "resnet50":
        return tf.keras.applications.ResNet50(weights=None, input_shape=dataset.input_shape,
                                              classes=dataset.num_classes, classifier_activation=None)
    raise SystemExit(f"unknown benchmark model {model!r}; one of {sorted(IMAGE_SHAPES)}")


def hvdtrain_stepper(ctx, model, dataset, batch_size: int, optimizer=None):
    """hvdtrain's :class:`~hvdtrain.trainer.Trainer` for ``model``, and ``run(n)`` that makes ``n``
    training steps exactly as ``Trainer.fit`` does (shard plan, compiled step) and waits for them.
    ``optimizer`` replaces hvdtrain's own (``build_optimizer``) to time a variant of the step."""
    import tensorflow as tf
    from hvdtrain import kerases
    from hvdtrain.config import OptimConfig
    from hvdtrain.optim import build_optimizer
    from hvdtrain.data.sharding import ShardPlan
    from hvdtrain import broadcast_state
    from hvdtrain.trainer import Trainer

    plan = ShardPlan(len(dataset.y_train), batch_size, ctx.size, ctx.rank)
    with tf.device(ctx.device):
        if optimizer is None:  # of the model's Keras (2 or 3)
            optimizer, _ = build_optimizer(OptimConfig(warmup_epochs=0), ctx.size, plan.steps_per_epoch, 100,
                                           keras=kerases.module(kerases.version_of(model)))
        optimizer.build(model.trainable_variables)
    broadcast_state(ctx, model, optimizer)
    trainer = Trainer(ctx, model, optimizer, dataset, plan)

    def batches():
        epoch = 0
        while True:
            for _, indices, count in plan.epoch(epoch):
                if len(indices) == batch_size:  # full batches only: every step times the same work
                    yield indices, np.float32(count)
            epoch += 1

    stream = batches()

    def run(n: int) -> None:
        for _ in range(n):
            trainer.train_step(*next(stream))
        trainer.wait()

    return trainer, run


def one_group_sgd():
    """SGD (rate 0.05, momentum 0.9) in Horovod's Keras wrapper with ``groups=1``: every gradient
    in one grouped allreduce, negotiated once, after the backward pass. The Keras wrapper itself:
    ``horovod.tensorflow.DistributedOptimizer`` hands a Keras optimizer on to it but drops
    ``groups`` (Horovod 0.28.1), and nothing would be grouped."""
    import horovod.tensorflow.keras as hvd_keras
    import tensorflow as tf

    return hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.05, momentum=0.9), groups=1)


def check_grouped(trainer) -> None:
    """Raise ``RuntimeError`` unless ``trainer``'s compiled step holds a grouped allreduce: a
    ``groups`` that Horovod dropped would silently time the default step again."""
    graph = trainer.train_step.get_concrete_function().graph.as_graph_def()
    ops = {n.op for n in graph.node} | {n.op for f in graph.library.function for n in f.node_def}
    if "HorovodGroupedAllreduce" not in ops:
        raise RuntimeError("the one-group optimizer made no grouped allreduce")


def at_least(minimum: int):
    """``argparse`` type for integers that must be at least ``minimum``.

    The returned function raises ``argparse.ArgumentTypeError`` for text below ``minimum``, which
    argparse reports as "argument --NAME: must be >= MINIMUM, got TEXT" (``int`` raises
    ``ValueError``, which argparse also reports, for text that is no integer).
    """
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
        return value

    parse.__name__ = f"integer >= {minimum}"  # argparse's "invalid <name> value" for non-integers
    return parse


# For counts (repeats, rounds, steps, warm-up steps: the first steps trace and must go untimed).
positive_int = at_least(1)


def step_variants_args(doc: str, name: str, rounds: int) -> argparse.Namespace:
    """Command line of a script that times variants of the seed CNN's step in jobs at np = 1 and 2
    (``step_breakdown.py``, ``thread_time.py``); ``name`` names its default plot,
    ``benchmarks/figures/<name>_<local_bn|sync_bn>.png``."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--sync-bn", action="store_true", help="hvdtrain's SyncBatchNormalization instead of per-rank BN")
    p.add_argument("--transport", default="mpi", choices=["gloo", "mpi"])
    p.add_argument("--batch-size", type=positive_int, default=128, help="local batch per rank")
    p.add_argument("--repeats", type=positive_int, default=3, help="jobs per np, alternating np = 1, 2")
    p.add_argument("--rounds", type=positive_int, default=rounds, help="alternating rounds per job")
    p.add_argument("--steps", type=positive_int, default=10, help="steps per variant per round")
    p.add_argument("--warmup", type=positive_int, default=5, help="untimed steps per variant first (tracing)")
    p.add_argument("--plot", default=None, help=f"PNG path (default: benchmarks/figures/{name}_<bn>.png)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    a.plot = a.plot or os.path.join(REPO, "benchmarks", "figures", f"{name}_{'sync_bn' if a.sync_bn else 'local_bn'}.png")
    return a


def step_variant_jobs(script: str, a: argparse.Namespace, describe) -> Dict[int, List[dict]]:
    """Run ``script``'s worker (options from :func:`step_variants_args`) in jobs at np = 1 and 2,
    alternating, ``a.repeats`` times each, one core per rank; print ``describe(result)`` after each.

    Returns:
        ``{np: [rank 0's result of each job, in order]}``.
    """
    args = ["--batch-size", str(a.batch_size), "--rounds", str(a.rounds), "--steps", str(a.steps),
            "--warmup", str(a.warmup)] + (["--sync-bn"] if a.sync_bn else [])
    jobs = {1: [], 2: []}
    for repeat in range(a.repeats):
        for np_ in jobs:
            transport = "single" if np_ == 1 and a.transport == "gloo" else a.transport
            result = run_job(np_, script, args, transport, cores=cores_for(np_))
            jobs[np_].append(result)
            print(f"np={np_} (repeat {repeat + 1}/{a.repeats}): {describe(result)}", flush=True)
    return jobs


def print_job_rss(jobs: Dict[int, List[dict]]) -> None:
    """Print each rank's peak RSS in the last job per np of :func:`step_variant_jobs`."""
    print("peak RSS per rank (MiB, every variant in one process; last job per np): " + "; ".join(
        f"np={np_}: " + ", ".join(f"{r:.0f}" for r in runs[-1]["rss_mib"]) for np_, runs in jobs.items()))
