"""Optimizer: SGD, Adam or AdamW on a world-size-scaled learning rate with warmup, wrapped by Horovod."""
from __future__ import annotations

import math
from types import ModuleType
from typing import Optional

import tensorflow as tf

from hvdtrain import kerases
from hvdtrain.config import LR_SCHEDULES, OptimConfig
from hvdtrain.errors import HvdtrainError
from hvdtrain.exchange import Exchange


class WarmupScheduleBase:
    """Linear warmup from ``base_lr`` to ``base_lr · world_size``, then a decay to the end of the run.

    Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour", §2.1-2.2: scale
    the learning rate linearly with the global batch (here: with the number of ranks, each with
    the same local batch) and reach it by gradual warmup, avoiding early instability. With
    gradient accumulation (K backward passes per update) an update averages K global batches at
    this same rate: the rate is not scaled by K (raise ``base_lr`` for that).

    Args:
        base_lr: float > 0, learning rate of one rank.
        world_size: int >= 1, the scale factor.
        warmup_steps: int >= 0, steps (backward passes: with accumulation, Horovod's
            ``optimizer.iterations`` counts every pass) of warmup.
        total_steps: int >= 1, steps of the whole run (``cosine`` and ``linear`` reach 0 there).
        decay: after warmup, ``cosine``: half a cosine to 0 (Loshchilov & Hutter 2017, "SGDR");
            ``linear``: a straight line to 0; ``step``: the peak divided by 10 at 50% and again at
            75% of the run's steps (He et al. 2016's CIFAR schedule); ``constant``: the peak.
        step_offset: int, added to the optimizer's iteration count: an elastic job that changed
            world size (and so steps per epoch) continues the schedule where its progress in
            epochs is (see :func:`rescale_schedule`).
        cosine: the schedule's configuration before ``decay`` existed (True: ``cosine``, False:
            ``constant``), for optimizers saved with it.

    Call arguments:
        step: the optimizer's iteration count (scalar, any numeric dtype).

    Returns:
        float32 scalar learning rate.

    Raises:
        ValueError: for another ``decay``.
    """

    def __init__(self, base_lr: float, world_size: int, warmup_steps: int, total_steps: int, decay: str = "cosine",
                 step_offset: int = 0, cosine: Optional[bool] = None):
        if cosine is not None:
            decay = "cosine" if cosine else "constant"
        if decay not in LR_SCHEDULES:
            raise ValueError(f"decay must be one of {LR_SCHEDULES}, got {decay!r}")
        self.base_lr = float(base_lr)
        self.world_size = int(world_size)
        self.warmup_steps = int(warmup_steps)
        self.total_steps = max(1, int(total_steps))
        self.decay = decay
        self.step_offset = int(step_offset)

    @property
    def peak_lr(self) -> float:
        """``base_lr · world_size``."""
        return self.base_lr * self.world_size

    def __call__(self, step):
        step = tf.cast(step, tf.float32) + float(self.step_offset)
        peak = tf.constant(self.peak_lr, tf.float32)
        warm = self.base_lr + (self.peak_lr - self.base_lr) * step / max(1, self.warmup_steps)
        progress = tf.clip_by_value((step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps), 0.0, 1.0)
        if self.decay == "cosine":
            after = 0.5 * peak * (1.0 + tf.cos(math.pi * progress))
        elif self.decay == "linear":
            after = peak * (1.0 - progress)
        elif self.decay == "step":
            fraction = step / self.total_steps
            after = peak * tf.where(fraction < 0.5, 1.0, tf.where(fraction < 0.75, 0.1, 0.01))
        else:
            after = peak
        return tf.where(step < self.warmup_steps, warm, after)

    def get_config(self):
        return {"base_lr": self.base_lr, "world_size": self.world_size, "warmup_steps": self.warmup_steps,
                "total_steps": self.total_steps, "decay": self.decay, "step_offset": self.step_offset}


def schedule_class(keras: ModuleType) -> type:
    """:class:`WarmupScheduleBase` as a ``LearningRateSchedule`` of ``keras`` (Keras 2 or 3),
    registered as ``hvdtrain>WarmupSchedule`` (:func:`hvdtrain.kerases.class_for`)."""
    return kerases.class_for(WarmupScheduleBase, keras, "optimizers.schedules.LearningRateSchedule")


def __getattr__(name):
    if name == "WarmupSchedule":  # Keras 2's; hvdtrain.keras3.WarmupSchedule is Keras 3's
        return schedule_class(kerases.keras2())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _keras_of(optimizer) -> ModuleType:
    return kerases.module(kerases.version_of(optimizer) or 2)


def _schedule(config: OptimConfig, world_size: int, steps_per_epoch: int, epochs: int, keras: ModuleType,
              step_offset: int = 0) -> WarmupScheduleBase:
    return schedule_class(keras)(
        base_lr=config.base_lr,
        world_size=world_size,
        warmup_steps=round(config.warmup_epochs * steps_per_epoch),
        total_steps=steps_per_epoch * max(1, epochs),
        decay=config.lr_schedule,
        step_offset=step_offset,
    )


def build_optimizer(config: OptimConfig, world_size: int, steps_per_epoch: int, epochs: int, variables=None,
                    keras: Optional[ModuleType] = None):
    """The configured optimizer on :class:`WarmupScheduleBase`, wrapped in ``hvd.DistributedOptimizer``.

    ``sgd`` (momentum, optionally Nesterov's), ``adam`` (Kingma & Ba 2015) or ``adamw`` (Adam with
    decoupled weight decay, Loshchilov & Hutter 2019), Keras' implementations (of Keras 2 or 3).
    The wrapper averages gradients over ranks by ring-allreduce (tensor fusion batches them into
    few large messages): Keras 2's in ``compute_gradients``
    (``opt.apply_gradients(opt.compute_gradients(loss, variables, tape=tape))``), Keras 3's in
    ``apply`` (``opt.apply(tape.gradient(loss, variables), variables)``). Keras clips
    (``clip_norm``: ``global_clipnorm``) and decays weights in the update, after the allreduce, so
    both act on the averaged gradient, as one process on the global batch would.

    Args:
        config: the optimizer section of the run's config.
        world_size: number of ranks (learning-rate scale).
        steps_per_epoch: steps (backward passes) per epoch, for warmup and decay lengths.
        epochs: epochs of the run.
        variables: the model's trainable variables: the optimizer's slots are built for them, and
            those of rank < 2 (biases, BatchNorm's scale and offset) are excluded from weight decay.
        keras: the model's Keras package (default: the variables', else Keras 2; :mod:`hvdtrain.kerases`).

    Returns:
        ``(optimizer, schedule)``.
    """
    if keras is None:  # the variables' Keras (Keras 3's variables are its own class), else Keras 2
        keras = kerases.module(next((kerases.version_of(v) for v in variables or () if kerases.version_of(v)), 2))
    inner, schedule = configured_optimizer(config, world_size, steps_per_epoch, epochs, keras)
    optimizer = distributed(inner, config)
    if variables is not None:  # on the wrapper: Horovod makes it anew from the inner optimizer's config
        if config.weight_decay:
            optimizer.exclude_from_weight_decay(var_list=[v for v in variables if len(v.shape) < 2])
        optimizer.build(variables)
    return optimizer, schedule


def configured_optimizer(config: OptimConfig, world_size: int, steps_per_epoch: int, epochs: int,
                         keras: ModuleType):
    """The configured Keras optimizer, not wrapped (:func:`build_optimizer`), and its
    :class:`WarmupScheduleBase`: ``(optimizer, schedule)``."""
    # Horovod's gradient aggregation counts every backward pass in optimizer.iterations, so the
    # schedule is in backward passes (steps), not in applied updates.
    schedule = _schedule(config, world_size, steps_per_epoch, epochs, keras)
    common = {"learning_rate": schedule, "global_clipnorm": config.clip_norm or None,
              "weight_decay": config.weight_decay or None}
    if config.name == "sgd":
        return keras.optimizers.SGD(momentum=config.momentum, nesterov=config.nesterov, **common), schedule
    if config.name == "adam":
        return keras.optimizers.Adam(**common), schedule
    return keras.optimizers.AdamW(**common), schedule


def distributed(inner, config: OptimConfig):
    """``inner`` (a Keras 2 or Keras 3 optimizer, configured or the user's own) wrapped in
    ``hvd.DistributedOptimizer``, with ``config``'s allreduce compression and gradient
    accumulation (Keras 3's through ``scripts/horovod-patches/0006-keras3-distributed-optimizer.patch``),
    whose gradients cross ranks through :class:`hvdtrain.exchange.Exchange`.
    Its learning rate (a number or any ``LearningRateSchedule``) is used as it is: a user's own
    optimizer is not rescaled by world size. Horovod makes the optimizer anew from its config, so
    weight-decay exclusions go on the returned one.

    Raises:
        HvdtrainError: if Horovod cannot make the optimizer anew from its ``get_config()`` (it
            does, to subclass it): a schedule or optimizer class Keras cannot deserialize.
    """
    import horovod.tensorflow as hvd

    compression = hvd.Compression.fp16 if config.fp16_allreduce else hvd.Compression.none
    try:
        optimizer = hvd.DistributedOptimizer(
            inner,
            compression=compression,
            backward_passes_per_step=config.backward_passes_per_step,
            average_aggregated_gradients=True,
            # Accumulating gradients over backward passes sums them into dense variables anyway.
            sparse_as_dense=config.backward_passes_per_step > 1,
        )
    except (TypeError, ValueError) as e:
        raise HvdtrainError(f"the optimizer {type(inner).__name__}: Horovod makes it anew from its get_config(), which "
                            f"failed ({type(e).__name__}: {e}); register a custom LearningRateSchedule or optimizer "
                            f"class with Keras' register_keras_serializable") from e
    # hvdtrain's exchange in place of Horovod's (fixed buckets; each sparse gradient the cheaper way):
    # where the wrapper allreduces, and where its gradient accumulation does.
    exchange = Exchange(average=True, compression=compression)
    optimizer._allreduce_grads = exchange  # pylint: disable=protected-access
    helper = getattr(optimizer, "_agg_helper", None)
    if helper is not None:
        setattr(helper, "allreduce_grads" if hasattr(helper, "allreduce_grads") else "_allreduce_grads", exchange)
    return optimizer


def rescale_schedule(optimizer, config: OptimConfig, world_size: int, steps_per_epoch: int, epochs: int,
                     epochs_done: float) -> WarmupScheduleBase:
    """Give ``optimizer`` the schedule of a new world size, continuing at ``epochs_done``.

    For elastic training: after ranks leave or join, the peak rate is ``base_lr · world_size``
    for the new world size, and warmup and decay continue from the same point of the run,
    measured in epochs (steps per epoch changed with the global batch). Retrace the step
    function afterwards: the schedule is read when it is traced.

    Args:
        optimizer: the (wrapped) Keras optimizer; its ``iterations`` keeps counting.
        config: the optimizer section of the run's config.
        world_size: the new number of ranks.
        steps_per_epoch: optimizer steps per epoch at the new world size.
        epochs: epochs of the run.
        epochs_done: progress so far, float epochs (completed epochs plus the fraction of the
            current epoch's examples already trained on).

    Returns:
        The new schedule (also set on the optimizer).
    """
    offset = round(epochs_done * steps_per_epoch) - int(optimizer.iterations.numpy())
    schedule = _schedule(config, world_size, steps_per_epoch, epochs, _keras_of(optimizer), step_offset=offset)
    optimizer.learning_rate = schedule
    return schedule


def users_optimizer(optimizer, config: OptimConfig):
    """A caller's own optimizer (:func:`hvdtrain.fit`'s ``optimizer=``), checked and :func:`distributed`.

    Raises:
        HvdtrainError: for anything but a Keras optimizer (Keras 2 or 3), or one Horovod cannot make anew.
    """
    version = kerases.version_of(optimizer)
    keras = kerases.module(version) if version else None
    bases = () if keras is None else (keras.optimizers.Optimizer,) + (
        (keras.optimizers.legacy.Optimizer,) if version == 2 else ())
    if not bases or not isinstance(optimizer, bases):
        raise HvdtrainError(f"optimizer must be a Keras optimizer object, got {type(optimizer).__name__}")
    schedule = getattr(optimizer, "_learning_rate", None)
    if version == 3 or not isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
        return distributed(optimizer, config)
    # Horovod makes the optimizer anew from its config, which (on tf_keras 2.15) cannot rebuild
    # Keras' own schedule objects: it is made with a number, and given the schedule object after.
    wrapped = distributed(type(optimizer).from_config({**optimizer.get_config(), "learning_rate": 0.0}), config)
    wrapped.learning_rate = schedule
    return wrapped


def last_learning_rate(optimizer) -> float:
    """The learning rate of the optimizer's last update, as Keras 2 reports it (Keras 3's
    ``learning_rate`` under a schedule is the next update's: here the schedule at the last step)."""
    rate = getattr(optimizer, "_learning_rate", None)
    if kerases.version_of(optimizer) == 3 and isinstance(rate, _keras_of(optimizer).optimizers.schedules.LearningRateSchedule):
        return float(rate(max(int(optimizer.iterations.numpy()) - 1, 0)))
    current = optimizer.learning_rate
    return float(current(optimizer.iterations) if callable(current) else current)
