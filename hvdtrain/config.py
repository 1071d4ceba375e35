"""The typed configuration tree of a training run, validated on construction.

Each setting is declared once, here, by :func:`setting`: its config key (the field), type, default,
command-line flag, range and help text. The command line (:func:`hvdtrain.cli.build_parser`), run
files (:mod:`hvdtrain.config_file`) and the flag reference (``docs/flags.md``, written by
``python -m hvdtrain.tools.flags``) are made from these declarations. Each section is a frozen
dataclass; its ``__post_init__`` checks every declared range (:func:`check_settings`), then the
rules between settings, raising a :class:`HvdtrainError` that names the flag and the value received.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterator, NamedTuple, Optional, Tuple

from hvdtrain.errors import HvdtrainError

DATASETS = ("idx", "npz", "synthetic", "tfrecord", "folder", "function")
STREAMING_DATASETS = ("tfrecord", "folder", "function")  # read by tf.data as training runs
AUGMENTATIONS = ("none", "flip", "standard")
DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"  # Debian's dataset-fashion-mnist
LR_SCHEDULES = ("cosine", "linear", "step", "constant")
OPTIMIZERS = ("sgd", "adam", "adamw")
PRECISIONS = ("fp32", "bf16", "fp16", "fp64")
LOSSES = ("sparse_categorical_crossentropy", "binary_crossentropy", "mse")
METRICS = ("accuracy", "top5", "mean_iou")
KERAS_VERSIONS = (0, 2, 3)  # --keras: 0 picks the Keras TensorFlow gives by default (hvdtrain.kerases)
CLASSES, TARGETS = "classes", "targets"  # what a loss takes as labels: class indices, or values


# Each section's title in --help and docs/flags.md (the settings of Config itself are "training").
SECTION_TITLES = {"": "training", "data": "data", "model": "model", "task": "loss and metrics", "optim": "optimizer",
                  "compute": "compute", "checkpoint": "checkpoints", "log": "output", "runtime": "runtime",
                  "elastic": "elastic training (horovodrun --min-np N --max-np M --host-discovery-script S)"}


class ConfigError(HvdtrainError):
    """A setting out of its range: ``"<flag> must be <requirement>, got <value>"``.

    Args:
        flag: the command-line flag of the setting (``--lr``).
        requirement: what it must be (``finite and > 0``).
        value: what was received.
    """

    def __init__(self, flag: str, requirement: str, value):
        super().__init__(f"{flag} must be {requirement}, got {value!r}")
        self.flag, self.requirement, self.value = flag, requirement, value


class Requirement(NamedTuple):
    """A setting's range: what it must be, in words (for errors and docs), and the test."""

    text: str
    holds: Callable[[Any], bool]


def _is_number(value) -> bool:
    """A finite int or float (not bool): ``inf`` and ``nan`` are never valid settings."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(minimum: int, below: Optional[int] = None, upper_text: Optional[str] = None) -> Requirement:
    """An integer >= ``minimum`` (and < ``below`` where given, its bound written ``upper_text``,
    e.g. ``"2^31)"`` or ``"19]"``)."""
    if below is None:
        return Requirement(f"an integer >= {minimum}", lambda v: _is_int(v) and v >= minimum)
    return Requirement(f"an integer in [{minimum}, {upper_text or f'{below})'}",
                       lambda v: _is_int(v) and minimum <= v < below)


def number(minimum: float, inclusive: bool = True, below: Optional[float] = None) -> Requirement:
    """A finite number >= ``minimum`` (> if not ``inclusive``; and < ``below`` where given)."""
    if below is not None:
        return Requirement(f"in [{minimum}, {below})", lambda v: _is_number(v) and minimum <= v < below)
    if inclusive:
        return Requirement(f"finite and >= {minimum}", lambda v: _is_number(v) and v >= minimum)
    return Requirement(f"finite and > {minimum}", lambda v: _is_number(v) and v > minimum)


def one_of(choices: tuple) -> Requirement:
    return Requirement(f"one of {choices}", lambda v: v in choices and not isinstance(v, bool))


BOOLEAN = Requirement("true or false", lambda v: isinstance(v, bool))


def setting(default, flag: str, help: str, *, requires: Optional[Requirement] = None,
            choices: Optional[tuple] = None, switch: Optional[str] = None, metavar: Optional[str] = None):
    """Declare one setting: a dataclass field whose metadata the command line and docs are made from.

    Args:
        default: the value without the flag.
        flag: the command-line flag, ``--name``.
        help: what it does, with its unit; ``(default: X)`` is appended where the default is not None.
        requires: its range (:func:`integer`, :func:`number`); ``choices`` imply one, unless given.
        choices: the values allowed.
        switch: a bool set by the flag alone: ``"on"`` (the flag sets True) or ``"off"`` (the flag,
            ``--no-...``, sets False).
        metavar: the flag's argument as ``--help`` shows it.
    """
    if choices is not None and requires is None:
        requires = one_of(choices)
    if switch is not None:
        requires = BOOLEAN
    return dataclasses.field(default=default, metadata={
        "flag": flag, "help": help, "requires": requires, "choices": choices, "switch": switch, "metavar": metavar})


def declared_settings(cls=None, prefix: str = "") -> Iterator[Tuple[str, dataclasses.Field, type]]:
    """``(config key, field, section class)`` of every declared setting of the tree, in order."""
    for field in dataclasses.fields(cls or Config):
        if dataclasses.is_dataclass(field.default):
            yield from declared_settings(type(field.default), f"{prefix}{field.name}.")
        elif "flag" in field.metadata:
            yield prefix + field.name, field, cls or Config


def check_settings(section) -> None:
    """Check each of ``section``'s declared settings against its range.

    Raises:
        ConfigError: naming the first setting's flag, its requirement and the value received.
    """
    for field in dataclasses.fields(section):
        requirement, value = field.metadata.get("requires"), getattr(section, field.name)
        if requirement is not None and not (value is None and field.default is None) and not requirement.holds(value):
            raise ConfigError(field.metadata["flag"], requirement.text, value)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the training data comes from."""

    dataset: str = setting(
        "idx", "--dataset", "in memory: idx (MNIST-family IDX directory), npz (keras.datasets-style .npz file), "
        "synthetic; streamed by tf.data: tfrecord (<data-dir>/train-*, test-*), folder (<data-dir>/train/<class>/"
        "*.jpg|jpeg|png|bmp|gif, test/<class>/...), function (--data)", choices=DATASETS)
    data_dir: str = setting(DEFAULT_DATA_DIR, "--data-dir", "the IDX or TFRecord directory, the image folder, or the "
                            ".npz file")
    function: Optional[str] = setting(
        None, "--data", "your own tf.data pipeline: package.module:function called as function(split='train'|'test', "
        "rank=, world_size=, seed=, epoch=) returning unbatched (image, label) pairs of the whole split "
        "(hvdtrain.data.function); for a --model object, examples (x[, y[, sample_weight]]) of any structure, "
        "called once per split", metavar="MODULE:FUNCTION",
        requires=Requirement("'package.module:function'", lambda v: isinstance(v, str) and ":" in v))
    eval_batch_size: int = setting(0, "--eval-batch-size", "examples per evaluation batch per rank (0: the local "
                                   "batch, --batch-size)", requires=integer(0))
    image_size: int = setting(0, "--image-size", "tfrecord/folder: resize to this square, pixels (center crop for "
                              "evaluation); 0 keeps the stored size, which every image must share", requires=integer(0))
    augment: str = setting("none", "--augment", "tfrecord/folder training augmentation: none, flip (left-right), "
                           "standard (random-resized-crop and flip; needs --image-size)", choices=AUGMENTATIONS)
    num_classes: int = setting(0, "--num-classes", "tfrecord/--data: the class count (0: max(label) + 1, every class "
                               "present in training)", requires=integer(0))
    tfrecord_image_key: str = setting("image/encoded", "--tfrecord-image-key",
                                      "tf.train.Example feature holding the encoded image (JPEG/PNG bytes)")
    tfrecord_label_key: str = setting("image/class/label", "--tfrecord-label-key",
                                      "tf.train.Example feature holding the int64 class index")
    shuffle_buffer: int = setting(10000, "--shuffle-buffer", "tfrecord: records in each rank's shuffle buffer (the "
                                  "files' order is shuffled each epoch too)", requires=integer(1))

    @property
    def streaming(self) -> bool:
        """Read by tf.data as training runs (not held in memory)."""
        return self.dataset in STREAMING_DATASETS

    def __post_init__(self):
        check_settings(self)
        if (self.dataset == "function") != bool(self.function):
            raise HvdtrainError("--data package.module:function is a dataset of its own: give it without --dataset"
                                if self.function else "--dataset function needs --data package.module:function")
        if self.dataset not in ("tfrecord", "folder") and (self.image_size or self.augment != "none"):
            raise HvdtrainError(f"--image-size and --augment apply to --dataset tfrecord and folder (decoded by "
                                f"hvdtrain), not {self.dataset}")
        if self.augment == "standard" and not self.image_size:
            raise HvdtrainError("--augment standard crops at random and resizes: it needs --image-size")
        if self.num_classes and self.dataset not in ("tfrecord", "function"):
            raise HvdtrainError(f"--num-classes applies to --dataset tfrecord and --data functions, not {self.dataset} "
                                f"(whose classes are " + ("its class folders)" if self.dataset == "folder" else
                                                          "max(label) + 1)"))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Which model to train, and its Keras (:mod:`hvdtrain.kerases`)."""

    name: str = setting(
        "cnn", "--model", "cnn, resnet20, unet (per-pixel logits), or package.module:function returning an uncompiled "
        "Keras model, Keras 2 or 3 (called with input_shape=(H, W, C), num_classes=K) whose outputs fit the labels: "
        "(batch, K) logits, no softmax ((batch, H, W, K) for label maps), or the targets' shape; or "
        "package.module:name of a Keras model object (or a function of no arguments returning one), compiled or with "
        "its own train_step, trained by its own step on the data as stored (hvdtrain.command_line_model)",
        requires=Requirement("a model name", lambda v: isinstance(v, str) and bool(v.strip())))
    sync_bn: bool = setting(True, "--no-sync-bn", "built-in models: per-rank BatchNorm instead of synchronized "
                            "BatchNorm (refused with a model function, which chooses its own layers)", switch="off")
    convert_sync_bn: bool = setting(False, "--convert-sync-bn", "a --model function's Keras BatchNormalization layers "
                                    "become synchronized BatchNorm (hvdtrain.convert_sync_batchnorm: same "
                                    "configuration and weights)", switch="on")
    keras: int = setting(0, "--keras", "the Keras the built-in models are built with: 2 or 3 (0: TensorFlow's, 3 on "
                         "TensorFlow >= 2.16, 2 on 2.15); a --model function's model brings its own",
                         choices=KERAS_VERSIONS, requires=Requirement(
                             "2 or 3 (0: TensorFlow's default)",
                             lambda v: v in KERAS_VERSIONS and not isinstance(v, bool)))

    def __post_init__(self):
        check_settings(self)
        if self.convert_sync_bn and not self.sync_bn:
            raise ConfigError("--convert-sync-bn", "true or false, and not with --no-sync-bn", self.convert_sync_bn)
        if not self.sync_bn and ":" in self.name:
            raise HvdtrainError(f"--no-sync-bn applies to the built-in models only; the function of --model "
                                f"{self.name!r} chooses its own layers (Keras' BatchNormalization normalizes each "
                                f"rank's batch, hvdtrain's SyncBatchNormalization the global batch)")


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """The loss the model minimizes and the metrics reported (:mod:`hvdtrain.metrics`)."""

    loss: str = setting(
        "sparse_categorical_crossentropy", "--loss", "sparse_categorical_crossentropy (class indices: (n,) labels, "
        "or (n, H, W) for segmentation), binary_crossentropy (multi-label targets in [0, 1]), mse (targets shaped "
        "like the outputs)", choices=LOSSES)
    label_smoothing: float = setting(0.0, "--label-smoothing", "label smoothing of the cross-entropies",
                                     requires=number(0, below=1))
    metrics: Optional[str] = setting(
        None, "--metrics", f"comma-separated, exact over all ranks: {', '.join(METRICS)} ('' for none; default: "
        f"accuracy, none for mse)", requires=Requirement("comma-separated names", lambda v: isinstance(v, str)))

    @property
    def metric_names(self) -> tuple:
        """The metrics' names, in order."""
        if self.metrics is None:
            return () if self.loss == "mse" else ("accuracy",)
        return tuple(name.strip() for name in self.metrics.split(",") if name.strip())

    def __post_init__(self):
        check_settings(self)
        if self.label_smoothing and self.loss == "mse":
            raise HvdtrainError("--label-smoothing applies to the cross-entropies, not --loss mse")
        for name in self.metric_names:
            if name not in METRICS:
                raise ConfigError("--metrics", f"comma-separated names among {METRICS}", self.metrics)
        if len(set(self.metric_names)) != len(self.metric_names):
            raise ConfigError("--metrics", "names that differ", self.metrics)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """The optimizer, its learning-rate schedule (:mod:`hvdtrain.optim`), gradient averaging."""

    name: str = setting("sgd", "--optimizer", "sgd (with --momentum), adam, or adamw (Adam with decoupled "
                        "--weight-decay)", choices=OPTIMIZERS)
    base_lr: float = setting(0.05, "--lr", "base learning rate for one rank; scaled by world size after warmup",
                             requires=number(0, inclusive=False))
    momentum: float = setting(0.9, "--momentum", "SGD momentum (Adam's first-moment decay stays Keras' 0.9)",
                              requires=number(0, below=1))
    nesterov: bool = setting(False, "--nesterov", "SGD with Nesterov momentum", switch="on")
    weight_decay: float = setting(
        0.0, "--weight-decay", "decoupled weight decay (Loshchilov & Hutter 2019): each update scales the kernels by "
        "1 - lr x this (biases and BatchNorm scale/offset are not decayed); adamw needs it > 0", requires=number(0))
    clip_norm: float = setting(0.0, "--clip-norm", "clip the averaged (global-batch) gradient, after the allreduce, to "
                               "this global L2 norm (0: off)", requires=number(0))
    warmup_epochs: float = setting(1.0, "--warmup-epochs", "epochs (may be fractional) of linear warmup from --lr to "
                                   "--lr x world size (Goyal et al. 2017)", requires=number(0))
    lr_schedule: str = setting("cosine", "--lr-schedule", "learning rate after warmup: cosine or linear decay to 0, "
                               "step (/10 at 50% and 75% of the run), or constant", choices=LR_SCHEDULES)
    fp16_allreduce: bool = setting(False, "--fp16-allreduce", "compress gradients to float16 for the allreduce (with "
                                   "--precision fp16 too: the gradients are unscaled, float32, before it)", switch="on")
    backward_passes_per_step: int = setting(1, "--backward-passes-per-step", "local batches whose gradients are "
                                            "accumulated per optimizer step", requires=integer(1))

    def __post_init__(self):
        check_settings(self)
        if self.name == "adamw" and not self.weight_decay:
            raise HvdtrainError("--optimizer adamw needs --weight-decay > 0 (with 0 it is --optimizer adam)")
        if self.name == "adam" and self.weight_decay:
            raise HvdtrainError("--optimizer adam with --weight-decay is AdamW: use --optimizer adamw")
        if self.nesterov and self.name != "sgd":
            raise HvdtrainError(f"--nesterov applies to --optimizer sgd, not {self.name}")


@dataclasses.dataclass(frozen=True)
class ComputeConfig:
    """How the training step computes (:mod:`hvdtrain.precision`)."""

    precision: str = setting("fp32", "--precision", "fp32, or mixed precision: layers compute in bfloat16 (bf16) or "
                             "float16 (fp16, with dynamic loss scaling); weights, loss and metrics stay float32. fp64: "
                             "everything in float64, a slow reference whose rounding (1e-16) leaves any gap between "
                             "world sizes a real one",
                             choices=PRECISIONS)
    xla: bool = setting(False, "--xla", "compile the forward and backward pass with XLA; the allreduce stays outside "
                        "it, so synchronized BatchNorm at more than one rank needs --no-sync-bn", switch="on")

    def __post_init__(self):
        check_settings(self)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Where rank 0 keeps checkpoints, and resuming from them."""

    dir: Optional[str] = setting(None, "--checkpoint-dir", "checkpoint directory (default: <log-dir>/checkpoints)")
    resume: bool = setting(False, "--resume", "continue from the latest checkpoint in --checkpoint-dir", switch="on")
    keep: int = setting(3, "--keep-checkpoints", "most recent checkpoints kept", requires=integer(1))
    every_steps: int = setting(0, "--checkpoint-every", "also checkpoint every this many steps within an epoch (0: at "
                               "the end of epochs only); --resume continues from the exact step", requires=integer(0))

    def __post_init__(self):
        check_settings(self)


@dataclasses.dataclass(frozen=True)
class LogConfig:
    """What rank 0 writes and prints."""

    dir: Optional[str] = setting(None, "--log-dir", "run directory for metrics.jsonl (evaluation.json if only "
                                 "evaluating), TensorBoard logs and checkpoints (default: runs/<date>-<time>)")
    log_every: int = setting(50, "--log-every", "steps between exact running metrics (TensorBoard's steps/), counted "
                             "within each epoch: none in epochs shorter than this", requires=integer(1))
    progress: bool = setting(True, "--no-progress", "no progress bar (one line per epoch only; the bar shows only "
                             "when stderr is a terminal)", switch="off")

    def __post_init__(self):
        check_settings(self)


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """How each process uses its host (:mod:`hvdtrain.runtime`)."""

    threads: int = setting(0, "--threads", "TensorFlow intra-op threads per rank (0 = one per CPU core of this rank's "
                           "own)", requires=integer(0))
    cpu: bool = setting(False, "--cpu", "train on the CPU even where GPUs are present", switch="on")
    stall_timeout: float = setting(120.0, "--stall-timeout", "seconds a rank may make no progress (waiting for a "
                                   "stalled, lost or unreachable rank) before the job aborts; 0 waits forever",
                                   requires=number(0))
    sync_bn_kernels: bool = setting(True, "--no-sync-bn-kernels", "synchronized BatchNorm on the CPU: TensorFlow ops "
                                    "instead of hvdtrain's single-pass kernels", switch="off")
    horovod_nice: int = setting(19, "--horovod-nice", "nice level of Horovod's threads on a CPU rank under MPI or "
                                "alone, so that its polling yields the cores to the compute (0: leave them be)",
                                requires=integer(0, 20, "19]"))
    pipeline_nice: int = setting(19, "--pipeline-nice", "nice level of the streamed input pipeline's threads, so "
                                 "that they decode while the training step waits instead of delaying it (0: the "
                                 "step's priority)", requires=integer(0, 20, "19]"))
    horovod_cycle_time_ms: float = setting(0.1, "--horovod-cycle-time", "ms between Horovod's looks for ready "
                                           "collectives (HOROVOD_CYCLE_TIME, which wins if set)",
                                           requires=number(0, inclusive=False))
    deterministic: bool = setting(
        False, "--deterministic", "TensorFlow's deterministic ops too (cuDNN's on a GPU): the same command repeats "
        "bit for bit at any world size without it on a CPU, as hvdtrain's gradient buckets are fused alone",
        switch="on")

    def __post_init__(self):
        check_settings(self)


@dataclasses.dataclass(frozen=True)
class ElasticConfig:
    """Elastic training (horovodrun --min-np N --max-np M --host-discovery-script S)."""

    enabled: bool = setting(False, "--elastic", "keep training while workers leave or join: state is committed in "
                            "memory and the learning rate and data shards follow the world size", switch="on")
    commit_every: int = setting(20, "--commit-every", "steps between in-memory commits; a lost worker costs at most "
                                "this many steps", requires=integer(1))

    def __post_init__(self):
        check_settings(self)


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole training run; its sections hold the rest."""

    epochs: int = setting(12, "--epochs", "passes over the training set (0 = evaluate only, into "
                          "<log-dir>/evaluation.json)", requires=integer(0))
    batch_size: int = setting(128, "--batch-size", "local batch: examples per rank per step (global batch = this x "
                              "world size)", requires=integer(1))
    seed: int = setting(0, "--seed", "seed of weights (broadcast from rank 0), data order and dropout",
                        requires=integer(0, 2**31, "2^31)"))
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    optim: OptimConfig = OptimConfig()
    compute: ComputeConfig = ComputeConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    elastic: ElasticConfig = ElasticConfig()

    def __post_init__(self):
        check_settings(self)
        if self.checkpoint.resume and self.checkpoint.dir is None and self.log.dir is None:
            raise HvdtrainError("--resume needs the run to continue: pass its --log-dir or --checkpoint-dir")
        passes = self.optim.backward_passes_per_step
        if passes > 1 and self.checkpoint.every_steps % passes:
            raise HvdtrainError(f"--checkpoint-every {self.checkpoint.every_steps} must be a multiple of "
                                f"--backward-passes-per-step {passes}: a checkpoint between the passes of one update "
                                f"would lose the gradients accumulated so far")
        if self.optim.name != "sgd" and passes > 1:
            raise HvdtrainError(f"--optimizer {self.optim.name} cannot be combined with --backward-passes-per-step "
                                f"{passes}: Horovod counts every pass in the optimizer's iterations, which Adam's bias "
                                f"correction reads as updates; use a larger --batch-size instead")
        if self.compute.precision == "fp64" and self.optim.fp16_allreduce:
            raise HvdtrainError("--precision fp64 cannot be combined with --fp16-allreduce: a float64 reference "
                                "whose gradients are rounded to float16 is none")
        if self.compute.precision == "fp16" and passes > 1:
            raise HvdtrainError(f"--precision fp16 cannot be combined with --backward-passes-per-step {passes}: a "
                                f"pass whose gradients overflow would spoil the whole accumulated update; use "
                                f"--precision bf16, which needs no loss scaling")
        if self.elastic.enabled and self.data.dataset in ("tfrecord", "function"):
            ranged = f"--data {self.data.function}" if self.data.function else "--dataset tfrecord"
            raise HvdtrainError(f"--elastic cannot be combined with {ranged}: each rank reads its own range of the "
                                f"stream, which a new world size moves; use --dataset folder, idx, npz or synthetic")
        if self.elastic.enabled and self.optim.backward_passes_per_step > 1:
            raise HvdtrainError(f"--elastic cannot be combined with --backward-passes-per-step "
                                f"{self.optim.backward_passes_per_step}: a reset would drop half-accumulated "
                                f"gradients; use a larger --batch-size instead")

    @property
    def eval_batch_size(self) -> int:
        """Examples per evaluation batch on each rank: ``data.eval_batch_size``, or the local batch."""
        return self.data.eval_batch_size or self.batch_size

    def to_dict(self) -> dict:
        """Plain nested dict (for the run's metadata and checkpoints)."""
        return dataclasses.asdict(self)
