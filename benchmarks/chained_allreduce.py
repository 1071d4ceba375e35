"""Latency of dependent allreduces, as synchronized BatchNorm runs them, by where Horovod's threads run.

    .venv/bin/python benchmarks/chained_allreduce.py                 # np=2, Gloo and MPI, 3 rounds
    .venv/bin/python benchmarks/chained_allreduce.py --chain 52 --rounds 5

Synchronized BatchNorm allreduces each layer's statistics before the next layer can start (and
its gradients' sums on the way back): a ResNet-50 or MobileNetV2 waits on ~100 allreduces in a row
per step, each of a few hundred bytes, so their latency, not bandwidth, is the cost. Each np=2 job
here (one core per rank, as hvdtrain pins them) runs ``--chain`` allreduces of 33 float64 values
(a 16-channel layer's count, sums and sums of squares), each the input of the next, inside one
``tf.function``, and prints the time per allreduce (median over ``--steps`` calls of the chain).

Jobs, alternating each round:

* Gloo, Horovod's threads where hvdtrain leaves them (the cores the rank was launched on);
* Gloo, Horovod's threads pinned to the rank's core with the rest (what hvdtrain did before);
* MPI (Horovod's threads pinned and at nice 19, as hvdtrain places them under MPI).
"""
import argparse
import os
import statistics
import time

import common


def worker(a) -> None:
    from hvdtrain.runtime import placement
    from hvdtrain.runtime.dist import init_distributed

    ctx = init_distributed(threads=1)
    import horovod.tensorflow as hvd
    import tensorflow as tf

    if a.pin_horovod:  # every thread on the rank's cores, Horovod's included
        placement.pin_threads(ctx.cpu_cores)

    @tf.function
    def chain(x):
        for i in range(a.chain):
            x = hvd.allreduce(x * 0.5, op=hvd.Sum, name=f"bench.chain.{i}")
        return x

    x = tf.ones([33], tf.float64)
    chain(x).numpy()  # trace, and let Horovod's response cache learn the names
    times = []
    for _ in range(a.steps):
        start = time.perf_counter()
        chain(x).numpy()
        times.append((time.perf_counter() - start) / a.chain)
    if ctx.rank == 0:
        common.write_result(a.result, {"ms": 1e3 * statistics.median(times)})
    ctx.close()


JOBS = [("Gloo, Horovod's threads on the launch's cores (hvdtrain)", "gloo", False),
        ("Gloo, Horovod's threads on the rank's core", "gloo", True),
        ("MPI (hvdtrain)", "mpi", False)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chain", type=common.positive_int, default=100, help="dependent allreduces per call")
    p.add_argument("--steps", type=common.positive_int, default=5, help="timed calls of the chain per job")
    p.add_argument("--rounds", type=common.positive_int, default=3)
    p.add_argument("--pin-horovod", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    cores = common.cores_for(2)
    ms = {name: [] for name, _, _ in JOBS}
    for r in range(a.rounds):
        for name, transport, pin in (JOBS if r % 2 == 0 else JOBS[::-1]):
            args = ["--chain", str(a.chain), "--steps", str(a.steps), *(["--pin-horovod"] if pin else [])]
            ms[name].append(common.run_job(2, os.path.abspath(__file__), args, transport, cores)["ms"])
    ours = ms[JOBS[0][0]]
    common.print_table(
        ["job (np=2, one core per rank)", "ms per allreduce (median of rounds)", "min - max", "/ hvdtrain's Gloo"],
        [[name, f"{statistics.median(v):.3f}", f"{min(v):.3f} - {max(v):.3f}", f"{common.median_ratio(v, ours):.2f}"]
         for name, v in ms.items()],
        f"{a.chain} chained allreduces of 33 float64 values in one tf.function, {a.rounds} round(s)")


if __name__ == "__main__":
    main()
