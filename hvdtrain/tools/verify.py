"""Check that your model trains at N ranks as at one process: ``hvdtrain verify``.

    python -m hvdtrain.tools.verify --np 2 --model mypkg.models:build [--dataset npz --data-dir d.npz]

trains the model for ``--steps`` steps twice from the same initial weights on the same global
batches: at world size ``--np`` (local batch ``--batch-size``, under ``horovodrun --gloo`` on this
host) and as one process (local batch ``np x --batch-size``), with the run's loss and a plain SGD
of the same effective learning rate; then prints each variable's relative difference
``|w_N - w_1| / |w_1|``. hvdtrain's own layers give differences of float32 rounding (1e-6); a layer
that computes from its rank's batch alone (Keras' ``BatchNormalization`` in training: per-rank
batch statistics), draws rank-dependent randomness or holds state outside its variables shows as
a larger one; so does dropout, whose masks each rank draws for its own examples (the built-in
``cnn`` has it: verify models without, or with it switched off). Exit status: 0 if every
variable is within ``--tolerance``, 1 if not, 2 on an error.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from typing import List

import numpy as np

from hvdtrain.config import DATASETS, DEFAULT_DATA_DIR, LOSSES, STREAMING_DATASETS
from hvdtrain.errors import HvdtrainError, say

TOLERANCE = 1e-5


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hvdtrain verify", description=__doc__.split("\n")[0])
    p.add_argument("--np", type=int, default=2, help="world size to compare with one process")
    p.add_argument("--model", required=True, help="cnn, resnet20, unet or package.module:function")
    p.add_argument("--dataset", choices=[d for d in DATASETS if d not in STREAMING_DATASETS], default="idx")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    p.add_argument("--loss", choices=LOSSES, default=LOSSES[0])
    p.add_argument("--batch-size", type=int, default=16, help="local batch of each of the --np ranks")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate of the global batch (not scaled)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=TOLERANCE, help="largest relative difference that passes")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # OUT.npz: run as a rank
    return p


def worker(a) -> None:
    """One rank (or the one process): train ``a.steps`` steps and save the variables to ``a.worker``."""
    from hvdtrain.runtime.dist import init_distributed

    ctx = init_distributed(threads=1)
    import tensorflow as tf

    from hvdtrain.config import OptimConfig
    from hvdtrain.data.datasets import load_dataset
    from hvdtrain.data.sharding import ShardPlan
    from hvdtrain.losses import get_loss
    from hvdtrain.model.zoo import build_model
    from hvdtrain.optim import build_optimizer
    from hvdtrain.task import build_objective, expected_outputs
    from hvdtrain.trainer import Trainer, broadcast_state

    loss = get_loss(a.loss)
    dataset = load_dataset(a.dataset, a.data_dir, a.seed, loss.labels)
    local_batch = a.batch_size * a.np // ctx.size  # one process takes the whole global batch
    plan = ShardPlan(dataset.num_train, local_batch, ctx.size, ctx.rank, seed=a.seed)
    if plan.steps_per_epoch < a.steps:
        raise HvdtrainError(f"{dataset.name}: {dataset.num_train} examples give {plan.steps_per_epoch} global batches "
                            f"of {plan.global_batch}, fewer than --steps {a.steps}")
    objective = build_objective(loss, (), dataset)
    tf.keras.utils.set_random_seed(a.seed)  # the same initial weights at both world sizes (rank 0's)
    model = build_model(a.model, dataset.input_shape, dataset.num_classes, seed=a.seed, rank=ctx.rank,
                        **expected_outputs(loss, dataset))
    config = OptimConfig(base_lr=a.lr / ctx.size, momentum=0.0, warmup_epochs=0, lr_schedule="constant")
    optimizer, _ = build_optimizer(config, ctx.size, plan.steps_per_epoch, 1, model.trainable_variables)
    broadcast_state(ctx, model, optimizer)
    trainer = Trainer(ctx, model, optimizer, dataset, plan, objective=objective)
    for step, indices, global_count in plan.epoch(0):
        if step == a.steps:
            break
        trainer.train_step(indices, np.float32(global_count))
    if ctx.rank == 0:
        np.savez(a.worker, **{f"{i}:{v.name}": v.numpy() for i, v in enumerate(model.variables)})
    ctx.close()


def differences(ranks: dict, single: dict) -> List[tuple]:
    """``[(name, shape, relative difference)]`` of each variable, in the model's order."""
    rows = []
    for key in sorted(single, key=lambda k: int(k.split(":", 1)[0])):
        norm = float(np.linalg.norm(single[key]))
        delta = float(np.linalg.norm(ranks[key] - single[key]))
        rows.append((key.split(":", 1)[1], single[key].shape, delta / max(norm, 1e-12)))
    return rows


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.worker:
        try:
            worker(a)
        except HvdtrainError as e:
            say(f"hvdtrain: error: {e}", sys.stderr)
            return 2
        return 0
    if a.np < 2 or a.batch_size < 1 or a.steps < 1:
        say("hvdtrain verify: error: --np must be >= 2, --batch-size and --steps >= 1", sys.stderr)
        return 2
    args = [arg for arg in (argv if argv is not None else sys.argv[1:])]
    with tempfile.TemporaryDirectory() as tmp:
        outputs = {}
        for world_size in (a.np, 1):
            out = os.path.join(tmp, f"np{world_size}.npz")
            python = [sys.executable, "-m", "hvdtrain.tools.verify", *args, "--worker", out]
            command = python if world_size == 1 else [
                sys.executable, "-m", "horovod.runner.launch", "-np", str(world_size), "-H", f"localhost:{world_size}",
                "--gloo", *python]
            # One process must not see a launcher's rank variables (it would wait for peers).
            env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "OMPI_", "PMI"))}
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                errors = [line for line in (done.stdout + done.stderr).splitlines() if "hvdtrain: error:" in line
                          or "Error" in line]
                say(f"hvdtrain verify: error: the run at world size {world_size} failed:\n"
                    + "\n".join(errors[-5:] or (done.stdout + done.stderr).splitlines()[-20:]), sys.stderr)
                return 2
            with np.load(out) as saved:
                outputs[world_size] = dict(saved)
    rows = differences(outputs[a.np], outputs[1])
    width = max(len(name) for name, _, _ in rows)
    say(f"{a.steps} steps of {a.model}: world size {a.np} (local batch {a.batch_size}) against one process "
        f"(batch {a.np * a.batch_size}); relative difference of each variable:")
    for name, shape, rel in rows:
        say(f"  {name:<{width}}  {str(tuple(shape)):<18} {rel:.2e}" + ("  <-- differs" if rel > a.tolerance else ""))
    worst = max(rel for _, _, rel in rows)
    if worst > a.tolerance:
        say(f"hvdtrain verify: the model trains differently at {a.np} ranks (largest difference {worst:.2e} > "
            f"{a.tolerance:g}): look for layers that compute from their rank's batch alone (Keras' "
            f"BatchNormalization: use hvdtrain.SyncBatchNormalization), draw rank-dependent randomness, or keep "
            f"state outside their variables; through the gradients, every variable before them differs too")
        return 1
    say(f"hvdtrain verify: equivalent (largest difference {worst:.2e} <= {a.tolerance:g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
