"""Command line: ``hvdtrain`` / ``python -m hvdtrain``, one process per rank under a launcher.

    horovodrun -np 2 --gloo python -m hvdtrain
    mpirun -np 4 -bind-to none -map-by slot python -m hvdtrain --model resnet20 --epochs 30
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
import time
from typing import List, Optional, Tuple

from hvdtrain.config import (AUGMENTATIONS, DATASETS, LOSSES, LR_SCHEDULES, METRICS, OPTIMIZERS, PRECISIONS, Config,
                             ConfigError)
from hvdtrain.config_file import config_from_flat, config_to_yaml, read_config_file
from hvdtrain.errors import Ending, HvdtrainError, RunEnded, say
from hvdtrain.runtime.launcher import launcher_rank
from hvdtrain.runtime.signals import defer_stop_signals, install_stop_handlers, restore_default_sigterm

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process ended by Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM: what launchers send on Ctrl-C, and schedulers on scancel or preemption
QUIET_EXIT_DELAY_S = 2.0


class _RankAwareParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (not its usage block), printed from rank 0 only;
    every rank still exits with status 2."""

    def error(self, message):
        if launcher_rank() == 0:
            say(f"{self.prog}: error: {message} (see {self.prog} --help)", sys.stderr)
            sys.exit(EXIT_ERROR)
        sys.exit(_quiet_exit())


class _DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to each flag's help, except where the default is None: those flags
    say in their help what happens without them."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; ``--help`` documents every flag with its default and unit."""
    d = Config()
    p = _RankAwareParser(
        prog="hvdtrain",
        description="Data-parallel training on Horovod + TensorFlow 2. Start one process per rank with "
                    "horovodrun or mpirun, e.g. 'horovodrun -np 2 --gloo python -m hvdtrain'. 'hvdtrain verify "
                    "--help': check that a model trains at N ranks as at one process.",
        formatter_class=_DefaultsHelpFormatter,
    )
    p.add_argument("--config", metavar="FILE", default=None,
                   help="YAML run file of settings (as --print-config writes them); flags given override it")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved settings (defaults, --config, flags) as YAML and exit")
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=int, default=d.epochs,
                   help="passes over the training set (0 = evaluate only, into <log-dir>/evaluation.json)")
    g.add_argument("--batch-size", type=int, default=d.batch_size,
                   help="local batch: examples per rank per step (global batch = this x world size)")
    g.add_argument("--lr", type=float, default=d.optim.base_lr,
                   help="base learning rate for one rank; scaled by world size after warmup")
    g.add_argument("--optimizer", choices=OPTIMIZERS, default=d.optim.name,
                   help="sgd (with --momentum), adam, or adamw (Adam with decoupled --weight-decay)")
    g.add_argument("--momentum", type=float, default=d.optim.momentum, help="SGD momentum")
    g.add_argument("--nesterov", action="store_true", help="SGD with Nesterov momentum")
    g.add_argument("--weight-decay", type=float, default=d.optim.weight_decay,
                   help="decoupled weight decay: each update scales the kernels by 1 - lr x this (biases and "
                        "BatchNorm scale/offset are not decayed)")
    g.add_argument("--clip-norm", type=float, default=d.optim.clip_norm,
                   help="clip the averaged (global-batch) gradient, after the allreduce, to this global L2 norm "
                        "(0: off)")
    g.add_argument("--warmup-epochs", type=float, default=d.optim.warmup_epochs,
                   help="epochs (may be fractional) of linear warmup from --lr to --lr x world size")
    g.add_argument("--lr-schedule", choices=LR_SCHEDULES, default=d.optim.lr_schedule,
                   help="learning rate after warmup: cosine or linear decay to 0, step (/10 at 50%% and 75%% of the run), or "
                        "constant")
    g.add_argument("--seed", type=int, default=d.seed, help="seed of weights, data order and dropout")
    g.add_argument("--fp16-allreduce", action="store_true",
                   help="compress gradients to float16 for the allreduce (with --precision fp16 too: the "
                        "gradients are unscaled, float32, before it)")
    g.add_argument("--precision", choices=PRECISIONS, default=d.compute.precision,
                   help="fp32, or mixed precision: layers compute in bfloat16 (bf16) or float16 (fp16, with "
                        "dynamic loss scaling); weights, loss and metrics stay float32")
    g.add_argument("--xla", action="store_true",
                   help="compile the forward and backward pass with XLA; the allreduce stays outside it, so "
                        "synchronized BatchNorm at more than one rank needs --no-sync-bn")
    g.add_argument("--backward-passes-per-step", type=int, default=d.optim.backward_passes_per_step,
                   help="local batches whose gradients are accumulated per optimizer step")

    g = p.add_argument_group("data and model")
    g.add_argument("--dataset", choices=DATASETS, default=d.data.dataset,
                   help="in memory: idx (MNIST-family IDX directory), npz (keras.datasets-style .npz file), synthetic; "
                        "streamed by tf.data: tfrecord (<data-dir>/train-*, test-*), folder "
                        "(<data-dir>/train/<class>/*.jpg|png, test/<class>/...), function (--data)")
    g.add_argument("--data-dir", default=d.data.data_dir,
                   help="the IDX or TFRecord directory, the image folder, or the .npz file")
    g.add_argument("--data", metavar="MODULE:FUNCTION", default=None,
                   help="your own tf.data pipeline: package.module:function called as function(split='train'|'test', "
                        "rank=, world_size=, seed=, epoch=) returning unbatched (image, label) pairs of the whole split")
    g.add_argument("--eval-batch-size", type=int, default=d.data.eval_batch_size,
                   help="examples per evaluation batch per rank (0: the local batch, --batch-size)")
    g.add_argument("--image-size", type=int, default=d.data.image_size,
                   help="tfrecord/folder: resize to this square (center crop for evaluation); 0 keeps the stored "
                        "size, which every image must share")
    g.add_argument("--augment", choices=AUGMENTATIONS, default=d.data.augment,
                   help="tfrecord/folder training augmentation: none, flip (left-right), standard (random-resized-crop "
                        "and flip; needs --image-size)")
    g.add_argument("--num-classes", type=int, default=d.data.num_classes,
                   help="tfrecord/--data: the class count (0: max(label) + 1, every class present in training)")
    g.add_argument("--tfrecord-image-key", default=d.data.tfrecord_image_key,
                   help="tf.train.Example feature holding the encoded image (JPEG/PNG bytes)")
    g.add_argument("--tfrecord-label-key", default=d.data.tfrecord_label_key,
                   help="tf.train.Example feature holding the int64 class index")
    g.add_argument("--shuffle-buffer", type=int, default=d.data.shuffle_buffer,
                   help="tfrecord: records in each rank's shuffle buffer (the files' order is shuffled each epoch too)")
    g.add_argument("--model", default=d.model.name,
                   help="cnn, resnet20, unet (per-pixel logits), or package.module:function returning an uncompiled "
                        "Keras model, Keras 2 or 3 (called with input_shape=(H, W, C), num_classes=K) whose outputs "
                        "fit the labels: (batch, K) logits, no softmax ((batch, H, W, K) for label maps), or the "
                        "targets' shape")
    g.add_argument("--keras", type=int, choices=(2, 3), default=d.model.keras,
                   help="the Keras the built-in models are built with (default: TensorFlow's, 3 on TensorFlow >= 2.16, "
                        "2 on 2.15); a --model function's model brings its own")
    g.add_argument("--loss", choices=LOSSES, default=d.task.loss,
                   help="sparse_categorical_crossentropy (class indices: (n,) labels, or (n, H, W) for segmentation), "
                        "binary_crossentropy (multi-label targets in [0, 1]), mse (targets shaped like the outputs)")
    g.add_argument("--label-smoothing", type=float, default=d.task.label_smoothing,
                   help="label smoothing of the cross-entropies, in [0, 1)")
    g.add_argument("--metrics", default=d.task.metrics,
                   help=f"comma-separated, exact over all ranks: {', '.join(METRICS)} ('' for none; default: "
                        f"accuracy, none for mse)")
    g.add_argument("--no-sync-bn", action="store_true",
                   help="built-in models: per-rank BatchNorm instead of synchronized BatchNorm (refused with a "
                        "model function, which chooses its own layers)")
    g.add_argument("--convert-sync-bn", action="store_true",
                   help="a --model function's Keras BatchNormalization layers become synchronized BatchNorm "
                        "(hvdtrain.convert_sync_batchnorm: same configuration and weights)")

    g = p.add_argument_group("output and checkpoints")
    g.add_argument("--log-dir", default=None,
                   help="run directory for metrics.jsonl (evaluation.json if only evaluating), TensorBoard logs "
                        "and checkpoints (default: runs/<date>-<time>)")
    g.add_argument("--checkpoint-dir", default=None, help="checkpoint directory (default: <log-dir>/checkpoints)")
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    g.add_argument("--keep-checkpoints", type=int, default=d.checkpoint.keep, help="most recent checkpoints kept")
    g.add_argument("--checkpoint-every", type=int, default=d.checkpoint.every_steps,
                   help="also checkpoint every this many steps within an epoch (0: at the end of epochs only); "
                        "--resume continues from the exact step")
    g.add_argument("--log-every", type=int, default=d.log.log_every,
                   help="steps between exact running metrics (TensorBoard's steps/), counted within each "
                        "epoch: none in epochs shorter than this")
    g.add_argument("--no-progress", action="store_true", help="no progress bar (one line per epoch only; the bar shows only when stderr is a terminal)")

    g = p.add_argument_group("runtime")
    g.add_argument("--threads", type=int, default=d.runtime.threads,
                   help="TensorFlow intra-op threads per rank (0 = one per CPU core of this rank's own)")
    g.add_argument("--cpu", action="store_true", help="train on the CPU even where GPUs are present")
    g.add_argument("--stall-timeout", type=float, default=d.runtime.stall_timeout,
                   help="seconds a rank may make no progress (waiting for a stalled, lost or unreachable rank) "
                        "before the job aborts; 0 waits forever")
    g.add_argument("--no-sync-bn-kernels", action="store_true",
                   help="synchronized BatchNorm on the CPU: TensorFlow ops instead of hvdtrain's single-pass kernels")
    g.add_argument("--horovod-nice", type=int, default=d.runtime.horovod_nice,
                   help="nice level of Horovod's threads on a CPU rank under MPI or alone (0: leave them be)")
    g.add_argument("--deterministic", action="store_true",
                   help="the same command repeats bit for bit at any world size: Horovod's tensor fusion off at 3+ "
                        "ranks (it groups gradients by timing, which changes their sums' order) and TensorFlow's "
                        "deterministic ops")
    g.add_argument("--horovod-cycle-time", type=float, default=d.runtime.horovod_cycle_time_ms,
                   help="ms between Horovod's looks for ready collectives (HOROVOD_CYCLE_TIME, which wins if set)")

    g = p.add_argument_group("elastic training (horovodrun --min-np N --max-np M --host-discovery-script S)")
    g.add_argument("--elastic", action="store_true",
                   help="keep training while workers leave or join: state is committed in memory and the "
                        "learning rate and data shards follow the world size")
    g.add_argument("--commit-every", type=int, default=d.elastic.commit_every,
                   help="steps between in-memory commits; a lost worker costs at most this many steps")
    return p


# Each flag's setting in the config tree; "!" marks a flag that switches its setting off.
FLAG_SETTINGS = {
    "epochs": "epochs", "batch_size": "batch_size", "seed": "seed",
    "optimizer": "optim.name", "lr": "optim.base_lr", "momentum": "optim.momentum", "nesterov": "optim.nesterov",
    "weight_decay": "optim.weight_decay", "clip_norm": "optim.clip_norm", "warmup_epochs": "optim.warmup_epochs",
    "lr_schedule": "optim.lr_schedule", "fp16_allreduce": "optim.fp16_allreduce",
    "backward_passes_per_step": "optim.backward_passes_per_step",
    "precision": "compute.precision", "xla": "compute.xla",
    "dataset": "data.dataset", "data_dir": "data.data_dir", "data": "data.function",
    "eval_batch_size": "data.eval_batch_size", "image_size": "data.image_size", "augment": "data.augment",
    "num_classes": "data.num_classes", "tfrecord_image_key": "data.tfrecord_image_key",
    "tfrecord_label_key": "data.tfrecord_label_key", "shuffle_buffer": "data.shuffle_buffer",
    "model": "model.name", "no_sync_bn": "!model.sync_bn", "convert_sync_bn": "model.convert_sync_bn",
    "keras": "model.keras",
    "loss": "task.loss", "label_smoothing": "task.label_smoothing", "metrics": "task.metrics",
    "log_dir": "log.dir", "log_every": "log.log_every", "no_progress": "!log.progress",
    "checkpoint_dir": "checkpoint.dir", "resume": "checkpoint.resume", "keep_checkpoints": "checkpoint.keep",
    "checkpoint_every": "checkpoint.every_steps",
    "threads": "runtime.threads", "cpu": "runtime.cpu", "stall_timeout": "runtime.stall_timeout",
    "no_sync_bn_kernels": "!runtime.sync_bn_kernels", "horovod_nice": "runtime.horovod_nice",
    "horovod_cycle_time": "runtime.horovod_cycle_time_ms", "deterministic": "runtime.deterministic",
    "elastic": "elastic.enabled", "commit_every": "elastic.commit_every",
}
_NOT_GIVEN = object()


def parse_command_line(argv: Optional[List[str]] = None) -> Tuple[Config, bool]:
    """Parse ``argv`` into a validated :class:`Config`: the defaults, then the settings of
    ``--config FILE``, then the flags given, each overriding the one before.

    Returns:
        ``(config, print_config)``: the config and whether ``--print-config`` was given.

    Raises:
        HvdtrainError: for a bad config file, or a value outside its range, naming the flag (or
            the file's key, where the value came from the file). Type errors in flags exit
            through argparse.
    """
    # Flags not given keep the sentinel (argparse sets defaults only for attributes not already
    # present), so that a config file's setting is overridden by given flags only.
    given = build_parser().parse_args(argv, argparse.Namespace(**{dest: _NOT_GIVEN for dest in FLAG_SETTINGS}))
    from_file = read_config_file(given.config) if given.config else {}
    from_flags = {}
    for dest, key in FLAG_SETTINGS.items():
        value = getattr(given, dest)
        if value is not _NOT_GIVEN:
            from_flags[key.lstrip("!")] = (not value) if key.startswith("!") else value
    if "data.function" in from_flags and "data.dataset" not in from_flags:
        from_flags["data.dataset"] = "function"  # --data names a dataset of its own
    if from_flags.get("data.dataset", "function") != "function" and "data.function" not in from_flags:
        from_flags["data.function"] = None  # --dataset replaces a run file's --data
    try:
        return config_from_flat({**from_file, **from_flags}), given.print_config
    except ConfigError as e:
        key = FLAG_SETTINGS.get(e.flag[2:].replace("-", "_"), "").lstrip("!")
        if key in from_file and key not in from_flags:
            raise HvdtrainError(f"config file {given.config}: {key} ({e.flag}) must be {e.requirement}, "
                                f"got {e.value!r}") from None
        raise


def config_from_args(argv: Optional[List[str]] = None) -> Config:
    """Parse ``argv`` into a validated :class:`Config` (:func:`parse_command_line`)."""
    return parse_command_line(argv)[0]


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point. Returns the process exit status: 0, or 2 for any error on any rank; exits with 130
    on Ctrl-C, 143 on SIGTERM (and the watchdog with 3 on a stall)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["verify"]:  # hvdtrain verify: N ranks against one process (no launcher needed)
        from hvdtrain.tools.verify import main as verify

        return verify(argv[1:])
    try:
        config, print_config = parse_command_line(argv)
    except HvdtrainError as e:  # the same flags on every rank: the launcher's rank 0 reports
        if launcher_rank() != 0:
            return _quiet_exit()
        say(f"hvdtrain: error: {e}", sys.stderr)
        return EXIT_ERROR
    if print_config:
        if launcher_rank() == 0:
            print(config_to_yaml(config), end="")
        return 0
    from hvdtrain.recipe import run  # imports TensorFlow: after argument checks, so --help is fast

    install_stop_handlers()  # launchers pass Ctrl-C on as SIGTERM, as Slurm does on scancel
    try:
        run(config)
    except RunEnded as ended:
        return leave(ended)
    defer_stop_signals()
    return 0


def leave(ended: RunEnded) -> int:
    """Print what this rank should of how the run ended (once per job) and return its exit
    status, or exit at once where Horovod's shutdown at exit would wait for peers that are gone
    or busy (:class:`~hvdtrain.errors.Ending`)."""
    defer_stop_signals()  # a SIGTERM now must not replace what is being reported
    if ended.ending in (Ending.INTERRUPTED, Ending.TERMINATED):
        if ended.message:
            say(ended.message, sys.stderr)
        os._exit(EXIT_TERMINATED if ended.ending is Ending.TERMINATED else EXIT_INTERRUPTED)
    restore_default_sigterm()  # as before the run: a launcher's SIGTERM ends a rank stuck in shutdown
    if ended.ending is Ending.QUIET:
        return _quiet_exit()
    if ended.traceback:
        cause = ended.cause
        traceback.print_exception(type(cause), cause, cause.__traceback__)
    if ended.message:
        say(ended.message, sys.stderr)
    if ended.ending is Ending.ALONE:
        sys.stderr.flush()
        os._exit(EXIT_ERROR)  # without Horovod's shutdown at exit, which would wait for the peers
    return EXIT_ERROR


def _quiet_exit() -> int:
    """Exit status for a rank that leaves printing the error to another: it waits a moment first,
    because launchers end the whole job when the first rank exits, which could otherwise cut off
    the printing rank before its message is out."""
    time.sleep(QUIET_EXIT_DELAY_S)
    return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
