"""Allreduce bandwidth: Horovod over Gloo and over MPI against raw MPI_Allreduce and memcpy.

    .venv/bin/python benchmarks/allreduce.py [--np 2] [--max-size-mib 256]

Runs, one after another in one invocation: Horovod's ``hvd.allreduce`` (float32 sum, eager, the
way hvdtrain's metrics and a user's code call it) under ``horovodrun --gloo`` and under
``mpirun`` (MPI transport), with and without ``hvd.Compression.fp16``; a raw ``MPI_Allreduce``
through mpi4py under the same ``mpirun`` (the floor Horovod adds its cost to); and a memcpy
(``numpy.copyto``) in this process, the single-host bandwidth limit. For message sizes 4 KiB ...
``--max-size-mib``, it reports the nccl-tests figures: algorithm bandwidth ``algbw = bytes / time``
and bus bandwidth ``busbw = algbw * 2 (n - 1) / n`` (what each rank's link carries in a ring
allreduce; comparable to the memcpy bandwidth). Then the effect of Horovod's tensor fusion: the
time to allreduce every gradient of ResNet-20 and of the seed CNN as separate tensors in one
``tf.function`` (as ``hvd.DistributedOptimizer`` does) with ``HOROVOD_FUSION_THRESHOLD=0``
against the default 64 MiB, under Horovod's own ``HOROVOD_DISABLE_GROUP_FUSION=0`` (hvdtrain's ``1``
would leave them unfused either way). Each rank has one core. Prints tables, peak memory per rank, and
writes a PNG plot. Reference for the definitions: NVIDIA nccl-tests, ``doc/PERFORMANCE.md``.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

import common

KIB = 1024


def sizes_bytes(max_mib: int):
    out, size = [], 4 * KIB
    while size <= max_mib * KIB * KIB:
        out.append(size)
        size *= 4
    return out


def repeats(size: int) -> int:
    """Enough repetitions for a steady median without spending minutes on 256 MiB."""
    return int(min(50, max(5, (64 * KIB * KIB) // size)))


def timed(fn, size: int, barrier) -> float:
    """Median seconds of ``fn()`` over ``repeats(size)`` calls after 2 warm-up calls."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(repeats(size)):
        barrier()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def horovod_worker(a) -> dict:
    from hvdtrain.runtime.dist import init_distributed

    common.horovods_own_fusion()  # Horovod's tensor fusion is what this measures
    ctx = init_distributed(threads=1, use_gpu=False)
    import horovod.tensorflow as hvd
    import tensorflow as tf

    def barrier():
        hvd.allreduce(tf.zeros(1), name="bench.barrier")

    result = {"sizes": {}, "fusion": {}}
    for size in sizes_bytes(a.max_size_mib):
        tensor = tf.ones(size // 4, tf.float32)
        row = {}
        for label, compression in (("none", hvd.Compression.none), ("fp16", hvd.Compression.fp16)):
            name = f"bench.{label}.{size}"
            row[label] = timed(lambda: hvd.allreduce(tensor, op=hvd.Sum, name=name, compression=compression).numpy(),
                               size, barrier)
        result["sizes"][size] = row
    from hvdtrain.model.zoo import resnet20, seed_cnn

    for model_name, build, shape in (("ResNet-20", resnet20, (32, 32, 3)), ("seed CNN", seed_cnn, (28, 28, 1))):
        model = build(shape, 10)
        grads = [tf.ones_like(v) for v in model.trainable_variables]

        @tf.function
        def allreduce_all(tensors):
            return [hvd.allreduce(t, op=hvd.Average, name=f"grad.{i}") for i, t in enumerate(tensors)]

        seconds = timed(lambda: allreduce_all(grads)[-1].numpy(), 1 << 20, barrier)
        result["fusion"][model_name] = {"seconds": seconds, "tensors": len(grads),
                                        "bytes": int(sum(int(np.prod(g.shape)) * 4 for g in grads))}
    result["np"] = ctx.size
    result["rss_mib"] = common.gather_rss(ctx)
    chief = ctx.is_chief
    ctx.close()
    return result if chief else None


def mpi4py_worker(a) -> dict:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    os.sched_setaffinity(0, [sorted(os.sched_getaffinity(0))[comm.rank % len(os.sched_getaffinity(0))]])
    result = {"sizes": {}}
    for size in sizes_bytes(a.max_size_mib):
        send, recv = np.ones(size // 4, np.float32), np.empty(size // 4, np.float32)
        result["sizes"][size] = {"none": timed(lambda: comm.Allreduce(send, recv, op=MPI.SUM), size, comm.Barrier)}
    rss = comm.allgather(common.peak_rss_mib())
    result.update(np=comm.size, rss_mib=rss)
    return result if comm.rank == 0 else None


def memcpy_seconds(size: int) -> float:
    src, dst = np.ones(size // 4, np.float32), np.empty(size // 4, np.float32)
    return timed(lambda: np.copyto(dst, src), size, lambda: None)


def gbps(size: int, seconds: float) -> float:
    return size / seconds / 1e9


def driver(a) -> None:
    args = ["--max-size-mib", str(a.max_size_mib)]
    cores = common.cores_for(a.np)  # every job on np cores, one per rank, whatever the machine has
    jobs = {
        "Horovod, Gloo": common.run_job(a.np, __file__, args + ["--backend", "horovod"], "gloo", cores=cores),
        "Horovod, MPI": common.run_job(a.np, __file__, args + ["--backend", "horovod"], "mpi", cores=cores),
        "mpi4py MPI_Allreduce": common.run_job(a.np, __file__, args + ["--backend", "mpi4py"], "mpi", cores=cores),
        "Horovod, Gloo, fusion off": common.run_job(a.np, __file__, args + ["--backend", "horovod"], "gloo",
                                                    cores=cores, env={"HOROVOD_FUSION_THRESHOLD": "0"}),
    }
    bus = 2 * (a.np - 1) / a.np
    columns = [("Horovod, Gloo", "none"), ("Horovod, Gloo", "fp16"), ("Horovod, MPI", "none"),
               ("Horovod, MPI", "fp16"), ("mpi4py MPI_Allreduce", "none")]
    rows, curves = [], {f"{j}{' fp16' if c == 'fp16' else ''}": [] for j, c in columns}
    sizes = sizes_bytes(a.max_size_mib)
    memcpy = []
    for size in sizes:
        row = [f"{size // KIB:,} KiB" if size < KIB * KIB else f"{size // (KIB * KIB)} MiB"]
        memcpy.append(gbps(size, memcpy_seconds(size)))
        for job, compression in columns:
            seconds = jobs[job]["sizes"][str(size)][compression]
            algbw = gbps(size, seconds)
            curves[f"{job}{' fp16' if compression == 'fp16' else ''}"].append(algbw)
            row.append(f"{seconds * 1e3:.3g} ms / {algbw:.2f} / {algbw * bus:.2f}")
        row.append(f"{memcpy[-1]:.2f}")
        rows.append(row)
    # fp16 columns: bandwidth of the float32 payload the caller reduces (effective), twice what the link carries.
    common.print_table(["size"] + [f"{j}{' fp16 (effective)' if c == 'fp16' else ''}: time / algbw / busbw GB/s"
                                   for j, c in columns] + ["memcpy GB/s"], rows,
                       title=f"float32 sum allreduce, np={a.np}, one core per rank (median time)")
    fusion_rows = []
    for model_name, on in jobs["Horovod, Gloo"]["fusion"].items():
        off = jobs["Horovod, Gloo, fusion off"]["fusion"][model_name]
        fusion_rows.append([model_name, on["tensors"], f"{on['bytes'] / 1e6:.2f} MB", f"{off['seconds'] * 1e3:.2f}",
                            f"{on['seconds'] * 1e3:.2f}", off["seconds"] / on["seconds"]])
    common.print_table(["gradients of", "tensors", "size", "fusion off ms", "fusion 64 MiB ms", "speed-up"],
                       fusion_rows, title="tensor fusion (Horovod over Gloo): all gradients, one tf.function")
    common.print_table(["job", "peak RSS per rank MiB"],
                       [[job, ", ".join(f"{r:.0f}" for r in result["rss_mib"])] for job, result in jobs.items()],
                       title=f"memory (largest message {a.max_size_mib} MiB)")
    plt = common.matplotlib_pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, values in curves.items():
        ax.plot(sizes, values, marker="o", label=label + " (algbw)")
    ax.plot(sizes, memcpy, "--", color="gray", label="memcpy")
    ax.set(xscale="log", yscale="log", xlabel="message size (bytes)", ylabel="GB/s",
           title=f"allreduce algorithm bandwidth, np={a.np}")
    ax.legend(fontsize=8)
    common.save_plot(fig, a.plot)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=common.at_least(2), default=2)
    p.add_argument("--max-size-mib", type=common.positive_int, default=256)
    p.add_argument("--plot", default=os.path.join(common.REPO, "benchmarks", "figures", "allreduce.png"))
    p.add_argument("--backend", choices=["horovod", "mpi4py"], help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    if not a.worker:
        return driver(a)
    result = horovod_worker(a) if a.backend == "horovod" else mpi4py_worker(a)
    if result is not None:
        common.write_result(a.result, result)


if __name__ == "__main__":
    sys.exit(main())
