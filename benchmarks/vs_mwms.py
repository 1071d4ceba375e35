"""hvdtrain against ``tf.distribute.MultiWorkerMirroredStrategy``: same model, data, batch, workers.

    .venv/bin/python benchmarks/vs_mwms.py [--np 2] [--rounds 3]

Alternates whole jobs: hvdtrain on np ranks (``mpirun``, or ``--transport gloo``, timed by
``benchmarks/scaling.py``'s worker), then np MultiWorkerMirroredStrategy workers on localhost (RING
collectives over gRPC, a custom training loop over ``distribute_datasets_from_function``, the
fastest input idiom of TensorFlow's guide). Each process gets one core and one intra-op thread
either way. Throughput is measured the same way in both (warm-up excluded, mean over timed
iterations). Two pairs, each as its user gets it: per-rank BatchNorm (hvdtrain's ``--no-sync-bn``
layer against Keras' ``BatchNormalization``), and synchronized BatchNorm (hvdtrain's layer against
Keras' ``BatchNormalization(synchronized=True)``). Prints the throughput ratio hvdtrain /
MWMS (the median of the rounds' own ratios), peak memory per rank, and writes a PNG plot.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import common


def mwms_worker(a) -> None:
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(a.threads)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    tf.config.set_visible_devices([], "GPU")
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING))
    workers = strategy.num_replicas_in_sync
    global_batch = a.batch_size * workers
    dataset = common.bench_dataset("cnn", a.batch_size, workers)

    def make_dataset(input_context):
        ds = tf.data.Dataset.from_tensor_slices((dataset.x_train, dataset.y_train))
        ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        ds = ds.repeat().shuffle(10000).batch(input_context.get_per_replica_batch_size(global_batch),
                                              drop_remainder=True)
        return ds.map(lambda x, y: (tf.cast(x, tf.float32) / 255.0, y)).prefetch(tf.data.AUTOTUNE)

    from hvdtrain.model.zoo import seed_cnn, unfused_norm

    with strategy.scope():
        tf.keras.utils.set_random_seed(0)
        norm = unfused_norm(lambda: tf.keras.layers.BatchNormalization(momentum=0.9, synchronized=a.sync_bn))
        model = seed_cnn(dataset.input_shape, dataset.num_classes, norm=norm)
        optimizer = tf.keras.optimizers.SGD(0.05 * workers, momentum=0.9)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    iterator = iter(strategy.distribute_datasets_from_function(make_dataset))

    @tf.function
    def train_step(it):
        def step_fn(inputs):
            x, y = inputs
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_fn(y, model(x, training=True)), global_batch_size=global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        # The per-replica loss, not reduced across workers: a reduction would add a collective per
        # step that hvdtrain's step does not make.
        return strategy.run(step_fn, args=(next(it),))

    def run(n):
        for _ in range(n):
            loss = train_step(iterator)
        strategy.experimental_local_results(loss)[0].numpy()  # the last step has finished

    img_secs = common.images_per_second(run, a.batch_size, a.warmup_batches, a.iters, a.batches_per_iter)
    mean, ci = common.mean_ci(img_secs)
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    with open(f"{a.result}.{task}", "w") as f:
        json.dump({"per_rank": mean, "ci": ci, "rss_mib": common.peak_rss_mib()}, f)


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def run_mwms(a, sync_bn: bool) -> dict:
    """Start ``a.np`` MWMS workers, one core each; return total img/s and per-worker peak RSS."""
    hosts = [f"localhost:{p}" for p in free_ports(a.np)]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "mwms")
        args = [sys.executable, __file__, "--worker", "mwms", "--result", out, "--batch-size", str(a.batch_size),
                "--iters", str(a.iters), "--batches-per-iter", str(a.batches_per_iter),
                "--warmup-batches", str(a.warmup_batches), "--threads", "1"] + (["--sync-bn"] if sync_bn else [])
        procs, logs = [], []
        for i, core in enumerate(common.cores_for(a.np)):
            env = common.env_for_ranks({"TF_CONFIG": json.dumps(
                {"cluster": {"worker": hosts}, "task": {"type": "worker", "index": i}})})
            logs.append(open(os.path.join(tmp, f"worker-{i}.log"), "w+"))  # files: a full pipe cannot block a worker
            procs.append(subprocess.Popen(["taskset", "-c", str(core), *args], env=env, cwd=common.REPO,
                                          stdout=logs[-1], stderr=subprocess.STDOUT, text=True))
        try:
            # All workers at once: one that fails leaves the others blocked in a collective, so stop
            # at the first failure instead of waiting out each worker in turn.
            deadline = time.time() + 900
            while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
                if time.time() > deadline:
                    raise SystemExit("MultiWorkerMirroredStrategy job still running after 900 s")
                time.sleep(0.2)
        finally:
            for p in procs:
                p.kill()
                p.wait()
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
            log.close()
        if any(p.returncode for p in procs):
            raise SystemExit("MultiWorkerMirroredStrategy job failed:\n" + "\n".join(o[-3000:] for o in outputs))
        results = []
        for i in range(a.np):
            with open(f"{out}.{i}") as f:
                results.append(json.load(f))
    return {"total": sum(r["per_rank"] for r in results), "rss_mib": [r["rss_mib"] for r in results]}


def driver(a) -> None:
    timing = ["--iters", str(a.iters), "--batches-per-iter", str(a.batches_per_iter),
              "--warmup-batches", str(a.warmup_batches), "--batch-size", str(a.batch_size)]
    scaling = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scaling.py")
    rows = []
    for sync_bn in (False, True):
        totals = {"hvdtrain": [], "MWMS": []}
        rss = {}
        for r in range(a.rounds):
            ours = common.run_job(a.np, scaling, ["--model", "cnn", "--threads", "1", *timing]
                                  + ([] if sync_bn else ["--no-sync-bn"]), a.transport, cores=common.cores_for(a.np))
            theirs = run_mwms(a, sync_bn)
            totals["hvdtrain"].append(ours["total"])
            totals["MWMS"].append(theirs["total"])
            rss = {"hvdtrain": max(ours["rss_mib"]), "MWMS": max(theirs["rss_mib"])}
            print(f"round {r + 1} ({'synchronized' if sync_bn else 'per-rank'} BN): hvdtrain {ours['total']:.0f} "
                  f"img/s, MWMS {theirs['total']:.0f} img/s", flush=True)
        med = {k: statistics.median(v) for k, v in totals.items()}
        pair = "synchronized BN" if sync_bn else "per-rank BN"
        rows.append([pair, f"{med['hvdtrain']:.0f}", f"{med['MWMS']:.0f}",
                     common.median_ratio(totals["hvdtrain"], totals["MWMS"]),  # paired by round
                     f"{rss['hvdtrain']:.0f}", f"{rss['MWMS']:.0f}"])
    common.print_table(["seed CNN", "hvdtrain img/s", "MWMS img/s", "hvdtrain / MWMS", "peak RSS/rank hvdtrain MiB",
                        "peak RSS/worker MWMS MiB"], rows,
                       title=f"hvdtrain over {a.transport}; np={a.np} workers, 1 core each, local batch {a.batch_size}, Fashion-MNIST; "
                             f"{a.rounds} alternating rounds: median throughputs, and the median of the rounds' ratios")
    common.grouped_bars(a.plot, [row[0] for row in rows],
                        {"hvdtrain": [float(row[1]) for row in rows],
                         "MultiWorkerMirroredStrategy": [float(row[2]) for row in rows]},
                        ylabel="images/s (total)", title=f"seed CNN, np={a.np}, local batch {a.batch_size}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=common.positive_int, default=2, help="workers (ranks), one core each")
    p.add_argument("--rounds", type=common.positive_int, default=3)
    p.add_argument("--transport", default="mpi", choices=["mpi", "gloo"], help="hvdtrain's launcher/transport")
    p.add_argument("--batch-size", type=common.positive_int, default=128, help="local batch per worker")
    p.add_argument("--warmup-batches", type=common.positive_int, default=10)
    p.add_argument("--iters", type=common.positive_int, default=10)
    p.add_argument("--batches-per-iter", type=common.positive_int, default=10)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--sync-bn", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--plot", default=os.path.join(common.REPO, "benchmarks", "figures", "vs_mwms.png"))
    p.add_argument("--worker", choices=["mwms"], help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    mwms_worker(a) if a.worker else driver(a)


if __name__ == "__main__":
    sys.exit(main())
