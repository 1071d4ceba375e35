"""The typed configuration tree of a training run, validated on construction.

Each section is a frozen dataclass whose ``__post_init__`` rejects bad values with a
:class:`HvdtrainError` naming the command-line flag and the value received.
One module over 400 lines: the whole tree in one place, each section's checks beside its fields.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from hvdtrain.errors import HvdtrainError

DATASETS = ("idx", "npz", "synthetic", "tfrecord", "folder", "function")
STREAMING_DATASETS = ("tfrecord", "folder", "function")  # read by tf.data as training runs
AUGMENTATIONS = ("none", "flip", "standard")
DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"  # Debian's dataset-fashion-mnist
LR_SCHEDULES = ("cosine", "linear", "step", "constant")
OPTIMIZERS = ("sgd", "adam", "adamw")
PRECISIONS = ("fp32", "bf16", "fp16")
LOSSES = ("sparse_categorical_crossentropy", "binary_crossentropy", "mse")
METRICS = ("accuracy", "top5", "mean_iou")
KERAS_VERSIONS = (0, 2, 3)  # --keras: 0 picks the Keras TensorFlow gives by default (hvdtrain.kerases)
CLASSES, TARGETS = "classes", "targets"  # what a loss takes as labels: class indices, or values


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


def _check(ok: bool, flag: str, requirement: str, value) -> None:
    if not ok:
        raise ConfigError(flag, requirement, value)


def _is_number(value) -> bool:
    """A finite int or float (not bool): ``inf`` and ``nan`` are never valid settings."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(value, flag: str, minimum: int) -> None:
    _check(_is_int(value) and value >= minimum, flag, f"an integer >= {minimum}", value)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the training data comes from.

    Attributes:
        dataset: in memory: ``idx`` (MNIST-family directory), ``npz`` (keras.datasets-style file)
            or ``synthetic``; streamed by tf.data: ``tfrecord`` (shards), ``folder`` (images in
            class folders) or ``function`` (the user's pipeline, ``function``).
        data_dir: the IDX or TFRecord directory, the image folder, or the NPZ file.
        function: ``package.module:function`` returning a ``tf.data.Dataset``
            (:mod:`hvdtrain.data.function`), for ``dataset == "function"``.
        eval_batch_size: examples per evaluation batch on each rank; 0: the local batch.
        image_size: ``tfrecord``/``folder``: side of the square images are resized to (center
            crop for evaluation); 0 keeps the stored size, which every image must share.
        augment: ``tfrecord``/``folder`` training: ``none``, ``flip`` (random left-right flip) or
            ``standard`` (random-resized-crop and flip; needs ``image_size``).
        num_classes: streamed datasets: the class count; 0 infers ``max(label) + 1`` (folders:
            their class folders).
        tfrecord_image_key, tfrecord_label_key: the ``tf.train.Example`` features of the encoded
            image (bytes) and its class (int64).
        shuffle_buffer: ``tfrecord``: records in each rank's shuffle buffer.
    """

    dataset: str = "idx"
    data_dir: str = DEFAULT_DATA_DIR
    function: Optional[str] = None
    eval_batch_size: int = 0
    image_size: int = 0
    augment: str = "none"
    num_classes: int = 0
    tfrecord_image_key: str = "image/encoded"
    tfrecord_label_key: str = "image/class/label"
    shuffle_buffer: int = 10000

    @property
    def streaming(self) -> bool:
        """Read by tf.data as training runs (not held in memory)."""
        return self.dataset in STREAMING_DATASETS

    def __post_init__(self):
        _check(self.dataset in DATASETS, "--dataset", f"one of {DATASETS}", self.dataset)
        _check_int(self.eval_batch_size, "--eval-batch-size", 0)
        _check_int(self.image_size, "--image-size", 0)
        _check(self.augment in AUGMENTATIONS, "--augment", f"one of {AUGMENTATIONS}", self.augment)
        _check_int(self.num_classes, "--num-classes", 0)
        _check_int(self.shuffle_buffer, "--shuffle-buffer", 1)
        if (self.dataset == "function") != bool(self.function):
            raise HvdtrainError("--data package.module:function is a dataset of its own: give it without --dataset"
                                if self.function else "--dataset function needs --data package.module:function")
        _check(self.function is None or isinstance(self.function, str) and ":" in self.function, "--data",
               "'package.module:function'", self.function)
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
    """Which model to train.

    Attributes:
        name: ``cnn``, ``resnet20`` or ``package.module:function``.
        sync_bn: built-in models use synchronized (True) or per-rank (False) batch normalization;
            a model function chooses its own layers, so False is refused with one.
        convert_sync_bn: convert a model function's Keras batch norm (:func:`hvdtrain.convert_sync_batchnorm`).
        keras: the Keras the built-in models are built with, 2 or 3; 0 is TensorFlow's default
            (3 on TensorFlow >= 2.16, 2 on 2.15). A model function's model, a caller's optimizer
            and callbacks bring their own Keras, which must be this one where given
            (:mod:`hvdtrain.kerases`).
    """

    name: str = "cnn"
    sync_bn: bool = True
    convert_sync_bn: bool = False
    keras: int = 0

    def __post_init__(self):
        _check(isinstance(self.name, str) and bool(self.name.strip()), "--model", "a model name", self.name)
        _check(self.keras in KERAS_VERSIONS and not isinstance(self.keras, bool), "--keras", "2 or 3 (0: TensorFlow's "
               "default)", self.keras)
        _check(isinstance(self.convert_sync_bn, bool) and not (self.convert_sync_bn and not self.sync_bn),
               "--convert-sync-bn", "true or false, and not with --no-sync-bn", self.convert_sync_bn)
        if not self.sync_bn and ":" in self.name:
            raise HvdtrainError(f"--no-sync-bn applies to the built-in models only; the function of --model "
                                f"{self.name!r} chooses its own layers (Keras' BatchNormalization normalizes each "
                                f"rank's batch, hvdtrain's SyncBatchNormalization the global batch)")


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """What the model learns: the loss it minimizes and the metrics reported (:mod:`hvdtrain.metrics`).

    Attributes:
        loss: ``sparse_categorical_crossentropy`` (class indices ``(n, ...)`` and logits with one
            more axis of K: classification, or segmentation with ``(n, H, W)`` labels),
            ``binary_crossentropy`` (multi-label: targets in [0, 1] shaped like the logits) or
            ``mse`` (targets shaped like the outputs).
        label_smoothing: in [0, 1), for the two cross-entropies.
        metrics: comma-separated names among ``accuracy``, ``top5`` and ``mean_iou``; ``""`` for
            none; None: ``accuracy`` (none for ``mse``).
    """

    loss: str = "sparse_categorical_crossentropy"
    label_smoothing: float = 0.0
    metrics: Optional[str] = None

    @property
    def metric_names(self) -> tuple:
        """The metrics' names, in order."""
        if self.metrics is None:
            return () if self.loss == "mse" else ("accuracy",)
        return tuple(name.strip() for name in self.metrics.split(",") if name.strip())

    def __post_init__(self):
        _check(self.loss in LOSSES, "--loss", f"one of {LOSSES}", self.loss)
        _check(_is_number(self.label_smoothing) and 0 <= self.label_smoothing < 1, "--label-smoothing", "in [0, 1)",
               self.label_smoothing)
        if self.label_smoothing and self.loss == "mse":
            raise HvdtrainError("--label-smoothing applies to the cross-entropies, not --loss mse")
        _check(self.metrics is None or isinstance(self.metrics, str), "--metrics", "comma-separated names", self.metrics)
        for name in self.metric_names:
            _check(name in METRICS, "--metrics", f"comma-separated names among {METRICS}", self.metrics)
        if len(set(self.metric_names)) != len(self.metric_names):
            raise ConfigError("--metrics", "names that differ", self.metrics)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """The optimizer, its learning-rate schedule, and gradient-averaging options.

    Attributes:
        name: ``sgd`` (with momentum), ``adam`` or ``adamw`` (Adam with decoupled weight decay).
        base_lr: learning rate for one rank; the peak rate is ``base_lr · world_size``.
        momentum: SGD momentum in [0, 1) (Adam's first-moment decay stays Keras' 0.9).
        nesterov: SGD with Nesterov momentum.
        weight_decay: decoupled weight decay (Loshchilov & Hutter 2019): each update first
            multiplies the kernels by ``1 - lr · weight_decay``; biases and BatchNorm's scale and
            offset (variables of rank < 2) are not decayed. 0 disables; ``adamw`` needs it > 0.
        clip_norm: clip the averaged gradient (after the allreduce: the global batch's gradient)
            to this global L2 norm; 0 disables.
        warmup_epochs: epochs of linear warmup from ``base_lr`` to ``base_lr · world_size``
            (Goyal et al. 2017); may be fractional; 0 disables.
        lr_schedule: after warmup, ``cosine`` or ``linear`` decay to 0 at the last step, ``step`` (/10 at
            50% and 75% of the run), or ``constant`` (:class:`hvdtrain.optim.WarmupSchedule`).
        fp16_allreduce: compress gradients to float16 for the allreduce.
        backward_passes_per_step: local gradient accumulation: batches per optimizer step.
    """

    name: str = "sgd"
    base_lr: float = 0.05
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    clip_norm: float = 0.0
    warmup_epochs: float = 1.0
    lr_schedule: str = "cosine"
    fp16_allreduce: bool = False
    backward_passes_per_step: int = 1

    def __post_init__(self):
        _check(self.name in OPTIMIZERS, "--optimizer", f"one of {OPTIMIZERS}", self.name)
        _check(_is_number(self.base_lr) and self.base_lr > 0, "--lr", "finite and > 0", self.base_lr)
        _check(_is_number(self.weight_decay) and self.weight_decay >= 0, "--weight-decay", "finite and >= 0",
               self.weight_decay)
        _check(_is_number(self.clip_norm) and self.clip_norm >= 0, "--clip-norm", "finite and >= 0", self.clip_norm)
        if self.name == "adamw" and not self.weight_decay:
            raise HvdtrainError("--optimizer adamw needs --weight-decay > 0 (with 0 it is --optimizer adam)")
        if self.name == "adam" and self.weight_decay:
            raise HvdtrainError("--optimizer adam with --weight-decay is AdamW: use --optimizer adamw")
        if self.nesterov and self.name != "sgd":
            raise HvdtrainError(f"--nesterov applies to --optimizer sgd, not {self.name}")
        _check(_is_number(self.momentum) and 0 <= self.momentum < 1, "--momentum", "in [0, 1)", self.momentum)
        _check(_is_number(self.warmup_epochs) and self.warmup_epochs >= 0, "--warmup-epochs", "finite and >= 0",
               self.warmup_epochs)
        _check(self.lr_schedule in LR_SCHEDULES, "--lr-schedule", f"one of {LR_SCHEDULES}", self.lr_schedule)
        _check_int(self.backward_passes_per_step, "--backward-passes-per-step", 1)


@dataclasses.dataclass(frozen=True)
class ComputeConfig:
    """How the training step computes.

    Attributes:
        precision: ``fp32``; ``bf16`` or ``fp16``: Keras' mixed-precision policy (layers compute in
            the half type, variables, loss and metrics stay float32); ``fp16`` adds dynamic loss
            scaling (:mod:`hvdtrain.precision`).
        xla: compile the forward and backward pass with XLA (``jit_compile``); the gradient
            allreduce and the update run outside the compiled function.
    """

    precision: str = "fp32"
    xla: bool = False

    def __post_init__(self):
        _check(self.precision in PRECISIONS, "--precision", f"one of {PRECISIONS}", self.precision)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Where rank 0 keeps checkpoints.

    Attributes:
        dir: checkpoint directory; None puts them under the run's log directory.
        resume: continue from the latest checkpoint in ``dir``.
        keep: number of most recent checkpoints kept.
        every_steps: also checkpoint every this many steps within an epoch (0: at epoch ends only).
    """

    dir: Optional[str] = None
    resume: bool = False
    keep: int = 3
    every_steps: int = 0

    def __post_init__(self):
        _check_int(self.keep, "--keep-checkpoints", 1)
        _check_int(self.every_steps, "--checkpoint-every", 0)


@dataclasses.dataclass(frozen=True)
class LogConfig:
    """What rank 0 writes and prints.

    Attributes:
        dir: run directory for metrics.jsonl (evaluation.json if there is nothing to train),
            TensorBoard logs and (by default) checkpoints; None makes ``runs/<date>-<time>``.
        log_every: steps between exact global running metrics (one small allreduce each).
        progress: show a tqdm progress bar per epoch (when stderr is a terminal).
    """

    dir: Optional[str] = None
    log_every: int = 50
    progress: bool = True

    def __post_init__(self):
        _check_int(self.log_every, "--log-every", 1)


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """How each process uses its host.

    Attributes:
        threads: TensorFlow intra-op threads per rank; 0 = one per CPU core of this rank's own.
        cpu: train on the CPU even where GPUs are present.
        stall_timeout: seconds without a finished step before a rank aborts (0 = wait forever).
        sync_bn_kernels: synchronized BatchNorm on the CPU uses hvdtrain's single-pass kernels
            where built (False: TensorFlow ops, the same quantities in two passes).
        horovod_nice: nice level of Horovod's threads on a CPU rank under MPI or alone, so that
            its polling yields the cores to the compute (0 leaves them be; 0..19).
        horovod_cycle_time_ms: ``HOROVOD_CYCLE_TIME``, unless the environment sets it: how often
            Horovod's background thread looks for ready collectives, milliseconds (> 0).
        deterministic: bit-identical runs at any world size (no tensor fusion, deterministic ops).
    """

    threads: int = 0
    cpu: bool = False
    stall_timeout: float = 120.0
    sync_bn_kernels: bool = True
    horovod_nice: int = 19
    horovod_cycle_time_ms: float = 0.1
    deterministic: bool = False

    def __post_init__(self):
        _check_int(self.threads, "--threads", 0)
        _check(isinstance(self.deterministic, bool), "--deterministic", "true or false", self.deterministic)
        _check(_is_number(self.stall_timeout) and self.stall_timeout >= 0, "--stall-timeout", "finite and >= 0",
               self.stall_timeout)
        _check(_is_int(self.horovod_nice) and 0 <= self.horovod_nice <= 19, "--horovod-nice", "an integer in [0, 19]",
               self.horovod_nice)
        _check(_is_number(self.horovod_cycle_time_ms) and self.horovod_cycle_time_ms > 0, "--horovod-cycle-time",
               "finite and > 0", self.horovod_cycle_time_ms)


@dataclasses.dataclass(frozen=True)
class ElasticConfig:
    """Elastic training (Horovod Elastic): workers may leave and join while the job runs.

    Attributes:
        enabled: run under ``horovodrun --min-np/--max-np --host-discovery-script``; a lost
            worker costs the steps since the last commit instead of the job.
        commit_every: steps between in-memory commits of the training state on every rank (each costs
            two small allreduces, a pass over the variables and their copy to host memory).
    """

    enabled: bool = False
    commit_every: int = 20

    def __post_init__(self):
        _check_int(self.commit_every, "--commit-every", 1)


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole training run.

    Attributes:
        epochs: passes over the training set (>= 0; 0 only evaluates).
        batch_size: local batch, examples per rank per step; the global batch is
            ``batch_size · world_size``.
        seed: seeds initial weights (broadcast from rank 0), data order and dropout.
    """

    epochs: int = 12
    batch_size: int = 128
    seed: int = 0
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
        _check_int(self.epochs, "--epochs", 0)
        _check_int(self.batch_size, "--batch-size", 1)
        _check(_is_int(self.seed) and 0 <= self.seed < 2**31, "--seed", "an integer in [0, 2^31)", self.seed)
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
