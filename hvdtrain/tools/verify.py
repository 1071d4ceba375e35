"""Check that your model trains at N ranks as at one process: ``hvdtrain verify``.

    python -m hvdtrain.tools.verify --np 2 --model mypkg.models:build [--dataset npz --data-dir d.npz]

trains the model for ``--steps`` steps three times from the same initial weights on the same
global batches, with the run's loss and a plain SGD of the same effective learning rate: at world
size ``--np`` (local batch ``--batch-size``, under ``horovodrun --gloo`` on this host), as one
process (local batch ``np x --batch-size``), and, in that process again from the initial weights,
with each batch's examples in reverse order: the same arithmetic summed in another order, which
shows how far the model's training amplifies rounding.

The three runs train in float64 (``--precision auto``, the default, where every layer can compute
in it; ``fp64`` insists, ``fp32`` compares in float32). There rounding sits near 1e-16, so each
variable's difference ``|w_N - w_1|`` (L2 norm) may be at most 1e-9 of its update ``|w_1 - w_0|``
(or of 1e-5 of the whole model's, for a variable that barely moves): no real difference is as
small. A model that cannot compute in float64 (a layer built with ``dtype="float32"``) is named and
compared in float32, against its rounding noise: a variable differs if its difference exceeds all
of 10x the reversed order's (at most 0.1 of its update: more "noise" is a model random per
example, such as dropout, not rounding), ``--tolerance`` (1e-3) of its update, and 1e-5 of the
whole model's update.

Step 1 decides, and each later step while the reversed order moves the model by less than the
tolerance / 1000: training amplifies rounding, in some models quickly (a MobileNetV2's 1e-13 after
step 1 passes 1e-12 at step 2, and by step 10 any two runs differ by as much as their update),
and past that point a comparison cannot tell rounding from a bug. hvdtrain's own layers agree; a
layer that computes from its rank's batch alone (Keras' ``BatchNormalization`` in training:
per-rank batch statistics; ``--convert-sync-bn`` converts them), draws rank-dependent randomness or
holds state outside its variables differs; so does dropout, whose masks each rank draws for its
own examples (the built-in ``cnn`` has it: verify models without). It prints a summary of the
first and last deciding step and the layers that differ (``--verbose``: every variable). Exit
status: 0 if equivalent, 1 if not, 2 on an error.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from typing import List

import numpy as np

from hvdtrain.config import DATASETS, DEFAULT_DATA_DIR, LOSSES, STREAMING_DATASETS
from hvdtrain.errors import HvdtrainError
from hvdtrain.console import say

TOLERANCE = 1e-3


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hvdtrain verify", description=__doc__.split("\n")[0])
    p.add_argument("--np", type=int, default=2, help="world size to compare with one process")
    p.add_argument("--model", required=True, help="resnet20, unet, cnn (has Dropout, whose masks differ per rank "
                                                  "by design: it fails) or package.module:function")
    p.add_argument("--dataset", choices=[d for d in DATASETS if d not in STREAMING_DATASETS], default="idx")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    p.add_argument("--loss", choices=LOSSES, default=LOSSES[0])
    p.add_argument("--batch-size", type=int, default=16, help="local batch of each of the --np ranks")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate of the global batch (not scaled)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", choices=("auto", "fp64", "fp32"), default="auto",
                   help="train the three runs in float64, where rounding (1e-16) cannot hide a real difference, or "
                        "in float32 against its rounding noise; auto: float64 where the model can compute in it")
    p.add_argument("--tolerance", type=float, default=TOLERANCE,
                   help="in float32: a difference this small relative to the variable's own update passes, even "
                        "above the noise")
    p.add_argument("--verbose", action="store_true", help="list every variable's difference, noise and update")
    p.add_argument("--convert-sync-bn", action="store_true",
                   help="convert the model's Keras BatchNormalization layers to synchronized ones first")
    p.add_argument("--keras", type=int, choices=(2, 3), default=0,
                   help="the Keras of a built-in model (default: TensorFlow's); a --model function's brings its own")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # OUT: run as a rank, write OUT.<order>.npz
    return p


def orders(world_size: int) -> tuple:
    """The batch orders a run of ``world_size`` trains in: the one process also trains reversed."""
    return ("forward", "reversed") if world_size == 1 else ("forward",)


def worker(a) -> None:
    """One rank (or the one process): train ``a.steps`` steps and save the variables to
    ``<a.worker>.forward.npz``; the one process then trains again from the same initial weights
    with each batch's examples reversed (``<a.worker>.reversed.npz``), reusing its model and traced
    step."""
    from hvdtrain.runtime.dist import init_distributed

    ctx = init_distributed(threads=1)

    from hvdtrain import kerases
    from hvdtrain.config import OptimConfig
    from hvdtrain.data.in_memory import load_dataset
    from hvdtrain.kerases import set_random_seed
    from hvdtrain.data.sharding import ShardPlan
    from hvdtrain.losses import get_loss
    from hvdtrain.model.zoo import build_model
    from hvdtrain.optim import build_optimizer
    from hvdtrain.precision import not_float64, set_precision
    from hvdtrain.task import build_objective, expected_outputs
    from hvdtrain.recipe_steps import broadcast_state
    from hvdtrain.trainer import Trainer

    loss = get_loss(a.loss)
    dataset = load_dataset(a.dataset, a.data_dir, a.seed, loss.labels)
    local_batch = a.batch_size * a.np // ctx.size  # one process takes the whole global batch
    plan = ShardPlan(dataset.num_train, local_batch, ctx.size, ctx.rank, seed=a.seed)
    if plan.steps_per_epoch < a.steps:
        raise HvdtrainError(f"{dataset.name}: {dataset.num_train} examples give {plan.steps_per_epoch} global batches "
                            f"of {plan.global_batch}, fewer than --steps {a.steps}")
    objective = build_objective(loss, (), dataset)

    def build(precision):
        set_precision(precision)
        set_random_seed(a.seed)  # the same initial weights at both world sizes (rank 0's)
        return build_model(a.model, dataset.input_shape, dataset.num_classes, seed=a.seed, rank=ctx.rank,
                           convert_sync_bn=a.convert_sync_bn, keras=a.keras, **expected_outputs(loss, dataset))

    model = build("fp32" if a.precision == "fp32" else "fp64")
    why = None if a.precision == "fp32" else not_float64(model)
    if why and a.precision == "fp64":
        raise HvdtrainError(f"{a.model} cannot train in float64 (--precision fp64): {why}; --precision fp32 "
                            f"compares in float32, against its rounding noise")
    if why:
        kerases.module(kerases.version_of(model)).backend.clear_session()  # the same layer names again
        model = build("fp32")
    if ctx.rank == 0:  # what the one process settles, the ranks' run then takes
        with open(f"{a.worker}.precision.json", "w") as f:
            json.dump({"precision": "fp32" if why or a.precision == "fp32" else "fp64", "why": why}, f)
    config = OptimConfig(base_lr=a.lr / ctx.size, momentum=0.0, warmup_epochs=0, lr_schedule="constant")
    optimizer, _ = build_optimizer(config, ctx.size, plan.steps_per_epoch, 1, model.trainable_variables,
                                   kerases.module(kerases.version_of(model)))
    broadcast_state(ctx, model, optimizer)
    trainer = Trainer(ctx, model, optimizer, dataset, plan, objective=objective)
    state = model.variables + list(optimizer.variables)
    initial = [v.numpy() for v in state]
    from hvdtrain.model.convert import keras_batch_norm_layers

    def save(order, step):  # every step, each to its file: where training amplifies rounding is found afterwards
        if ctx.rank == 0:
            np.savez(snapshot_path(a.worker, order, step), **{f"{i}:{_name(v)}": v.numpy()
                                                              for i, v in enumerate(model.variables)})

    # The same examples summed in another order: how far this model's training amplifies rounding.
    for order in orders(ctx.size):
        for variable, value in zip(state, initial, strict=True):
            variable.assign(value)
        save(order, 0)
        for step, indices, global_count in plan.epoch(0):
            if step == a.steps:
                break
            trainer.train_step(indices[::-1] if order == "reversed" else indices, np.float32(global_count))
            save(order, step + 1)
    if ctx.rank == 0:
        np.save(f"{a.worker}.keras_bn.npy", np.array([layer.name for layer in keras_batch_norm_layers(model)], str))
    ctx.close()


def snapshot_path(out: str, order: str, step: int) -> str:
    """Where a run (``out``) saves its variables after ``step`` of ``order`` (0: the initial ones)."""
    return f"{out}.{order}.step{step}.npz"


def snapshot(out: str, order: str, step: int) -> dict:
    """``<index>:<name>`` -> the variable after ``step`` (:func:`snapshot_path`)."""
    with np.load(snapshot_path(out, order, step)) as saved:
        return dict(saved)


NOISE_FACTOR = 10.0  # a difference this many times the rounding noise's is no rounding
NOISE_CAP = 0.1  # of a variable's update: more "noise" than this is randomness per example (dropout), not rounding
FLOOR = 1e-5  # of the whole model's update: below it, a variable's difference is negligible
# In float64 rounding starts near 1e-16 of each operation; the steps amplify it, and no real
# difference (a layer of its rank's batch alone) is as small.
FP64_TOLERANCE = 1e-9
# After step 1, a step decides while the reversed order moves the model by less than the tolerance
# over this: its rounding, amplified by the steps, must stay far under what is called a difference.
CHAOS_MARGIN = 1000.0


@dataclasses.dataclass
class Row:
    """One variable after one step: its differences (L2 norms) from the one-process run."""

    name: str
    shape: tuple
    difference: float  # |w_N - w_1|: the N-rank run's
    noise: float  # |w_reversed - w_1|: the same examples summed in another order
    update: float  # |w_1 - w_0|: how far the one-process run moved it

    def differs(self, tolerance: float, model_update: float, fp64: bool = False) -> bool:
        """In float64, beyond :data:`FP64_TOLERANCE` of its update; in float32, beyond all of its
        rounding noise (:data:`NOISE_FACTOR`, capped), ``tolerance`` of its update, and
        :data:`FLOOR` of the model's."""
        if fp64:
            return self.difference > FP64_TOLERANCE * max(self.update, FLOOR * model_update)
        noise = min(NOISE_FACTOR * self.noise, NOISE_CAP * self.update)
        return self.difference > max(noise, tolerance * self.update, FLOOR * model_update)


def compare(ranks: dict, single: dict, reversed_: dict, initial: dict) -> List[Row]:
    """The :class:`Row` of each variable after one step, in the model's order, from the three runs'
    variables then and the one process's initial ones (:func:`snapshot`)."""
    rows = []
    for key in sorted(single, key=lambda k: int(k.split(":")[0])):
        w1 = single[key]
        rows.append(Row(key.split(":", 1)[1], w1.shape, float(np.linalg.norm(ranks[key] - w1)),
                        float(np.linalg.norm(reversed_[key] - w1)), float(np.linalg.norm(w1 - initial[key]))))
    return rows


def total(rows: List[Row], field: str) -> float:
    """The whole model's norm of ``field`` over ``rows``."""
    return float(np.sqrt(sum(getattr(row, field) ** 2 for row in rows)))


def _name(variable) -> str:
    """A variable's name with its layer's: Keras 2's ``name`` (``block_1_expand_BN/gamma:0``), Keras 3's ``path``."""
    return getattr(variable, "path", None) or variable.name


def layer_of(variable: str) -> str:
    """``block_1_expand_BN`` of ``block_1_expand_BN/gamma:0`` (Keras 3's paths keep the model's name
    before it: ``functional/block_1_expand_BN``); the variable itself where it has no layer."""
    return variable.rsplit("/", 1)[0] if "/" in variable else variable


def failure(output: str) -> str:
    """What a failed run said: its ``hvdtrain: error:`` messages, each once (every rank may print
    the same one), else its last lines."""
    marker = "hvdtrain: error: "
    said = list(dict.fromkeys(line.split(marker, 1)[1] for line in output.splitlines() if marker in line))
    return "; ".join(said) if said else "\n" + "\n".join(output.splitlines()[-20:])


def _listed(names: List[str], shown: int = 8) -> str:
    return ", ".join(names[:shown]) + (f" (and {len(names) - shown} more)" if len(names) > shown else "")


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.worker:
        try:
            worker(a)
        except HvdtrainError as e:
            say(f"hvdtrain: error: {e}", sys.stderr)
            return 2
        return 0
    if a.np < 2 or a.batch_size < 1 or a.steps < 1 or not a.tolerance > 0:
        say("hvdtrain verify: error: --np must be >= 2, --batch-size and --steps >= 1, --tolerance > 0", sys.stderr)
        return 2
    args = [arg for arg in (argv if argv is not None else sys.argv[1:])]
    with tempfile.TemporaryDirectory() as tmp:
        try:
            precision, why = train_runs(a, args, tmp)
        except _RunFailed as e:
            say(f"hvdtrain verify: error: {e}", sys.stderr)
            return 2
        return judge(a, precision, why, os.path.join(tmp, "ranks"), os.path.join(tmp, "single"))


class _RunFailed(Exception):
    pass


def train_runs(a, args: List[str], tmp: str) -> tuple:
    """Train the one process (forward and reversed), then the ``a.np`` ranks, into ``tmp``.

    Returns:
        ``(precision, why)``: what the one process settled (``auto``: ``fp64`` unless a layer
        cannot compute in it, or the model fails in it) and why not float64 (None if it is).

    Raises:
        _RunFailed: saying which run failed and what it printed.
    """
    precision, why = a.precision, None
    for run, world_size in (("single", 1), ("ranks", a.np)):
        out = os.path.join(tmp, run)
        done = _train(args, precision, out, world_size)
        if done.returncode != 0 and world_size == 1 and precision == "auto":
            why = f"it fails in float64: {failure(done.stdout + done.stderr)}"
            precision = "fp32"
            done = _train(args, precision, out, world_size)
        if done.returncode != 0:
            hint = " (in float64: --precision fp32 compares in float32)" if precision != "fp32" else ""
            raise _RunFailed(f"the run at world size {world_size} failed{hint}: " + failure(done.stdout + done.stderr))
        if world_size == 1:
            with open(f"{out}.precision.json") as f:
                settled = json.load(f)
            precision, why = settled["precision"], settled["why"] or why
    return precision, why


def _train(args: List[str], precision: str, out: str, world_size: int) -> subprocess.CompletedProcess:
    python = [sys.executable, "-m", "hvdtrain.tools.verify", *args, "--precision", precision, "--worker", out]
    command = python if world_size == 1 else [
        sys.executable, "-m", "horovod.runner.launch", "-np", str(world_size), "-H", f"localhost:{world_size}",
        "--gloo", *python]
    # One process must not see a launcher's rank variables (it would wait for peers).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "OMPI_", "PMI"))}
    return subprocess.run(command, env=env, capture_output=True, text=True)


def judge(a, precision: str, why, ranks: str, single: str) -> int:
    """Compare the runs step by step, print the verdict, and return the exit status (0 or 1)."""
    fp64 = precision == "fp64"
    how = ("in float64: rounding near 1e-16, so a difference above "
           f"{FP64_TOLERANCE:g} of a variable's update is real" if fp64 else
           "in float32" + (f" ({why}, so not in float64)" if why else "")
           + "; rounding noise: that process with each batch's examples in reverse order")
    say(f"{a.steps} steps of {a.model}: world size {a.np} (local batch {a.batch_size}) against one process (batch "
        f"{a.np * a.batch_size}), {how}")
    # Each step decides while the reversed order's own difference stays small: past that, training
    # has amplified rounding until any two runs differ (MobileNetV2: by its update within 10 steps).
    chaos = (FP64_TOLERANCE if fp64 else a.tolerance) / CHAOS_MARGIN
    decided, chaotic_from, per_step = [], None, {}
    initial = snapshot(single, "forward", 0)
    for step in range(1, a.steps + 1):
        rows = compare(snapshot(ranks, "forward", step), snapshot(single, "forward", step),
                       snapshot(single, "reversed", step), initial)
        update = total(rows, "update")
        whole = Row("model", (), total(rows, "difference"), total(rows, "noise"), update)
        if step > 1 and whole.noise > chaos * update:
            chaotic_from = step
            break
        per_step[step] = (rows, whole, [row for row in rows if row.differs(a.tolerance, update, fp64)])
        decided.append(step)
        if per_step[step][2] or whole.differs(a.tolerance, update, fp64):
            break  # the first step that differs is the one to show
    for step in sorted({decided[0], decided[-1]}):
        rows, whole, differing = per_step[step]
        say(f"  after step {step}: |w_{a.np} - w_1| = {whole.difference / max(whole.update, 1e-300):.2e} of the update "
            f"(reversed order {whole.noise / max(whole.update, 1e-300):.2e}); {len(differing)} of {len(rows)} "
            f"variables beyond " + (f"{FP64_TOLERANCE:g}" if fp64 else "it"))
        if a.verbose:
            width = max(len(row.name) for row in rows)
            for row in rows:
                say(f"    {row.name:<{width}}  {str(tuple(row.shape)):<18} difference {row.difference:.2e}  noise "
                    f"{row.noise:.2e}  update {row.update:.2e}" + ("  <-- differs" if row in differing else ""))
    if chaotic_from is not None:
        deciding = "step 1 decides" if chaotic_from == 2 else f"steps 1-{chaotic_from - 1} decide"
        say(f"  from step {chaotic_from} the reversed order alone moves the model by more than {chaos:g} of its "
            f"update (its training amplifies rounding until any two runs differ): {deciding}")
    rows, whole, differing = per_step[decided[-1]]
    whole_model_differs = whole.differs(a.tolerance, whole.update, fp64)
    first_rows = per_step[1][0]
    if total(first_rows, "noise") > NOISE_CAP * total(first_rows, "update"):
        say(f"hvdtrain verify: the reversed order moves the model by more than {NOISE_CAP:g} of its first update: "
            f"it is random per example (Dropout? random augmentation?), which no rank count can repeat"
            + ("" if fp64 else f"; its differences are held to {NOISE_CAP:g} of each update"))
    if differing or whole_model_differs:
        layers = list(dict.fromkeys(layer_of(row.name) for row in differing))
        per_rank = list(np.load(f"{single}.keras_bn.npy"))
        named = (f"; the first layers whose variables differ after step {decided[-1]}: {_listed(layers)}"
                 if layers else "")
        named += (f". It has {len(per_rank)} Keras BatchNormalization layer(s), which normalize each rank's batch "
                  f"alone: {_listed(per_rank)}" if per_rank else "")
        say(f"hvdtrain verify: the model trains differently at {a.np} ranks{named}. Look for layers that compute from "
            f"their rank's batch alone (Keras' BatchNormalization: hvdtrain.convert_sync_batchnorm, or "
            f"--convert-sync-bn), draw rank-dependent randomness, or keep state outside their variables; through "
            f"the gradients, every variable before them differs too (--verbose lists every variable)")
        return 1
    if fp64:
        say(f"hvdtrain verify: equivalent in float64 (every difference within {FP64_TOLERANCE:g} of the variable's "
            f"update, or of {FLOOR:g} of the model's for a variable that barely moves)")
    else:
        say(f"hvdtrain verify: equivalent in float32 (every difference within {NOISE_FACTOR:g}x the rounding noise, "
            f"{a.tolerance:g} of the variable's update, or {FLOOR:g} of the model's)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
