"""Steps 2-4 of the recipe for a Keras model object, trained by its own ``train_step``.

:func:`hvdtrain.fit` takes this path for a model object (built, or compiled; Keras' default step
or the model's own): the data in any of Keras' ``fit`` forms (:mod:`hvdtrain.data.examples`), the
model compiled as the user compiled it (or with ``fit``'s loss, metrics and optimizer), every
optimizer it holds wrapped by :class:`~hvdtrain.keras_step.GradientExchange`, and one probe step
that builds what a first step builds. Steps 1 and 5-9 are the recipe's own
(:mod:`hvdtrain.recipe`), and so is the training loop (:class:`hvdtrain.trainer.Trainer`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import List, Optional

import tensorflow as tf

from hvdtrain import kerases
from hvdtrain.config import Config
from hvdtrain.data.examples import Examples, StreamedExamples, as_example, class_weights
from hvdtrain.data.sharding import ShardPlan
from hvdtrain.errors import EveryRankError, HvdtrainError
from hvdtrain.keras_step import GradientExchange, MetricSums, has_own_step, model_optimizers, probe, step_name
from hvdtrain.runtime.dist import DistContext
from hvdtrain.runtime.watchdog import Watchdog
from hvdtrain.user_code import name_of


def is_model_object(model) -> bool:
    """A Keras 2 or 3 ``Model`` instance (not a build function, not a built-in model's name)."""
    version = kerases.version_of(model)
    return bool(version) and not isinstance(model, type) and isinstance(model, kerases.module(version).Model)


@dataclasses.dataclass
class OwnStep:
    """Step 4's result on this path.

    Attributes:
        exchange: the gradient exchange every optimizer of the model goes through.
        optimizers: those optimizers (the first reports the learning rate and counts updates).
        objective: the model's metrics as sums (:class:`~hvdtrain.keras_step.MetricSums`).
        schedule: hvdtrain's warmup schedule where hvdtrain made the optimizer, else None.
        step: what trains, for the banner: ``"Keras' default train_step"`` or ``"<Class>.train_step"``.
        own: whether that is the model's own step or ``compute_loss`` (exact only for batch-mean losses).
    """

    exchange: GradientExchange
    optimizers: list
    objective: MetricSums
    schedule: Optional[object]
    step: str
    own: bool = False

    def banner_lines(self) -> List[str]:
        """Rank 0's lines on what trains and how exact it is."""
        names = ", ".join(self.objective.names) or "none"
        exact = ("exact for a loss that is a mean over the batch's examples" if self.own
                 else "exact for losses averaged over the batch's examples, Keras' default reduction")
        lines = [f"step:  {self.step}; {len(self.optimizers)} optimizer(s), each update's gradients summed over "
                 f"ranks, each rank's weighted by its share of the global batch ({exact})",
                 f"task:  metrics {names} (exact: their sums allreduced over ranks)"]
        if self.objective.extras:
            lines.append(f"       {', '.join(self.objective.extras)}: the step's last value, averaged over ranks "
                         f"(not exact)")
        return lines


def examples_from(data, *, x=None, y=None, sample_weight=None, class_weight=None, validation_data=None,
                  shuffle_buffer: int = 10_000, seed: int = 0):
    """``fit``'s data for a model object as :class:`Examples` or :class:`StreamedExamples`.

    Args:
        data: ``(x_train, y_train, x_test, y_test)`` (each part any nest of arrays),
            ``(train, test)`` ``tf.data`` datasets of unbatched examples (``test`` may be None), a data
            function (:mod:`hvdtrain.data.function`'s signature, returning such datasets: then a
            function of ``rank``, ``world_size`` that makes them), or None with ``x`` (and ``y``,
            ``sample_weight``), as Keras' ``fit`` takes them.
        validation_data: with ``x``: ``(x, y[, sample_weight])`` for evaluation.
        class_weight: ``{class: weight}`` for one label array (Keras' rule).

    Raises:
        HvdtrainError: for forms it does not take, both ``sample_weight`` and ``class_weight``, or a
            ``class_weight`` for a class no label holds.
    """
    if isinstance(data, (tuple, list)) and len(data) == 2 and any(isinstance(d, tf.data.Dataset) for d in data):
        if class_weight is not None:
            raise HvdtrainError("hvdtrain.fit: class_weight with tf.data datasets: put the weights in the elements, "
                                "(x, y, sample_weight)")
        return StreamedExamples(data[0], data[1], shuffle_buffer, seed)
    if isinstance(data, tf.data.Dataset):
        raise HvdtrainError("hvdtrain.fit(data=...) got one tf.data.Dataset; pass (train, test) or (train, None)")
    if callable(data):  # a data function: called by open_examples, where the rank is known
        beside = [k for k, v in (("x", x), ("y", y), ("sample_weight", sample_weight), ("class_weight", class_weight),
                                 ("validation_data", validation_data)) if v is not None]
        if beside:
            raise HvdtrainError(f"hvdtrain.fit: a data function with {', '.join(beside)}=: its examples hold them, "
                                f"(x, y, sample_weight), and its 'test' split the test set")
        return functools.partial(StreamedExamples.of_function, data, f"hvdtrain.fit(data={name_of(data)})",
                                 seed=seed, shuffle_buffer=shuffle_buffer)
    if data is not None:
        if not isinstance(data, (tuple, list)) or len(data) != 4 or x is not None:
            raise HvdtrainError("hvdtrain.fit(model, data): data is (x_train, y_train, x_test, y_test), (train, test) "
                                "tf.data datasets, or give x=, y=, validation_data= as Keras' fit takes them")
        x, y, vx, vy = data
        validation_data = (vx, vy) if vx is not None else None
    if x is None:
        raise HvdtrainError("hvdtrain.fit: no training data: give data=(x_train, y_train, x_test, y_test), "
                            "(train, test) datasets, or x= (and y=)")
    if class_weight is not None:
        if sample_weight is not None:
            raise HvdtrainError("hvdtrain.fit: give sample_weight or class_weight, not both (Keras' rule)")
        sample_weight = class_weights(y, class_weight, "hvdtrain.fit(class_weight=...)")
    if sample_weight is not None and y is None:
        raise HvdtrainError("hvdtrain.fit: sample_weight without y")
    train = (x,) if y is None else (x, y) if sample_weight is None else (x, y, sample_weight)
    test = as_example(tuple(validation_data), "validation_data") if validation_data is not None else None
    return Examples(train, test)


def open_examples(ctx: DistContext, config: Config, parts, watchdog: Watchdog):
    """Step 2 on this path: the caller's examples, checked alike on every rank; the shard plan.

    Raises:
        EveryRankError: for a training set smaller than one global batch.
        FoundHere / PeerFailure: for a rank whose examples differ from rank 0's.
    """
    from hvdtrain.recipe_steps import RankData, agree_on_data

    watchdog.beat("loading data")
    kerases.set_random_seed(config.seed)
    examples = parts.examples
    if callable(examples):  # a data function's (examples_from)
        examples = ctx.guarded("calling the data function", lambda: parts.examples(rank=ctx.rank, world_size=ctx.size))
    fingerprint = ctx.guarded("reading the data", examples.fingerprint)
    agree_on_data(ctx, fingerprint)
    plan = ShardPlan(examples.num_train, config.batch_size, ctx.size, ctx.rank, seed=config.seed)
    if examples.num_train < plan.global_batch:
        raise EveryRankError(f"{examples.name}: {examples.num_train} training examples are fewer than one global "
                             f"batch ({ctx.size} ranks x batch size {config.batch_size}); use a smaller batch size")
    return RankData(examples, None, fingerprint, plan)


def refuse_settings(config: Config) -> None:
    """What this path does not do yet, refused by name rather than ignored.

    Raises:
        EveryRankError: for ``--elastic``, a ``--precision`` other than fp32 (the model is built
            already: set Keras' mixed-precision policy before building it), ``--xla`` or gradient
            accumulation.
    """
    precision = config.compute.precision
    refused = [name for name, on in (("elastic", config.elastic.enabled),
                                     (f"precision {precision}", precision != "fp32"),
                                     ("xla", config.compute.xla),
                                     ("backward_passes_per_step > 1", config.optim.backward_passes_per_step > 1)) if on]
    if refused:
        raise EveryRankError(f"a Keras model object trains by its own train_step, which hvdtrain does not yet run with "
                             f"{', '.join(refused)}; pass a build function (model_fn(input_shape, num_classes)) for them")


def _padding_hint(structure: List[str]) -> str:
    """For a failed first step: which parts have rows of variable length, zero-padded per batch."""
    varying = [line.rsplit(" (", 1)[0].rsplit(" ", 1)[0] for line in structure if "None" in line.rsplit(" (", 1)[1]]
    if not varying:
        return ""
    return (f" ({', '.join(varying)}: rows of variable length, zero-padded per batch to the batch's longest, "
            f"so the model must take any length, as keras.Input((None,)) does)")


def is_compiled(model) -> bool:
    """Whether Keras 3 (``compiled``) or Keras 2 (``_is_compiled``) holds the model compiled."""
    return bool(getattr(model, "compiled", False) or getattr(model, "_is_compiled", False))


def _compile_args(model) -> Optional[dict]:
    """The arguments a model was compiled with (the user's objects), or None where Keras does not
    keep them, or the model has a ``compile()`` of its own (keras.io's distiller)."""
    keras = kerases.module(kerases.version_of(model))
    if type(model).compile is not keras.Model.compile:
        return None
    kept = getattr(model, "_compile_config", None)  # Keras 3's
    if kept is not None:
        return dict(kept.config)
    get = getattr(model, "_get_compile_args", None)  # Keras 2's
    return dict(get()) if get is not None else None


def build_model(ctx: DistContext, config: Config, parts, data):
    """Step 3 on this path: the caller's model (BatchNorm synchronized with ``convert_sync_bn``),
    compiled: as the caller compiled it, with ``fit``'s loss, metrics, optimizer and loss weights
    where ``fit`` names them, or with ``fit``'s alone (hvdtrain's configured optimizer, on its
    warmup schedule, where none is given).

    Returns:
        ``(model, keras, schedule)``: hvdtrain's schedule, or None for the caller's optimizer.

    Raises:
        EveryRankError: for settings this path refuses (:func:`refuse_settings`).
        HvdtrainError: for ``fit``'s loss, metrics or optimizer given with a model compiled by a
            ``compile()`` of its own, or a model of two Kerases.
    """
    from hvdtrain.model.convert import convert_sync_batchnorm
    from hvdtrain.optim import configured_optimizer, rescale_schedule

    refuse_settings(config)
    model = parts.model
    keras = kerases.module(kerases.choose(kerases.version_of(model), model=model, optimizer=parts.optimizer))
    given = {k: v for k, v in (("loss", parts.loss), ("metrics", parts.metrics), ("optimizer", parts.optimizer),
                               ("loss_weights", parts.loss_weights)) if v is not None}
    if is_compiled(model) and given and not config.model.convert_sync_bn:
        compiled = _compile_args(model)
        if compiled is None:
            raise HvdtrainError(f"hvdtrain.fit: the model has a compile() of its own, and fit got {', '.join(given)} "
                                f"too: give them to model.compile()")
        # What fit names replaces what compile() was given; the rest stays as compiled.
        model.compile(**{**{k: v for k, v in compiled.items() if v is not None}, **given})
    if config.model.convert_sync_bn:
        if is_compiled(model):
            raise HvdtrainError("hvdtrain.fit: convert_sync_bn needs an uncompiled model (the converted model is a new "
                                "one): compile after hvdtrain.convert_sync_batchnorm(model), or give fit loss= "
                                "and optimizer=")
        with tf.device(ctx.device):
            model = convert_sync_batchnorm(model)
    schedule = None
    if not is_compiled(model):
        if parts.loss is None and not has_own_step(model):
            raise HvdtrainError(f"hvdtrain.fit: the model is not compiled and fit got no loss=: Keras' default "
                                f"train_step needs one (compile the model, or give loss=)")
        optimizer = parts.optimizer
        if optimizer is None:
            optimizer, schedule = configured_optimizer(config.optim, ctx.size, data.plan.steps_per_epoch,
                                                       config.epochs, keras)
            optimizer._hvdtrain_configured = True  # noqa: SLF001 -- a later fit gives it a schedule of its own
        model.compile(optimizer=optimizer, loss=parts.loss, metrics=parts.metrics, loss_weights=parts.loss_weights)
    elif getattr(model.optimizer, "_hvdtrain_configured", False):
        # fit again on a model hvdtrain compiled: its warmup and decay start anew, from the steps taken
        # (the first fit's cosine has reached 0)
        schedule = rescale_schedule(model.optimizer, config.optim, ctx.size, data.plan.steps_per_epoch,
                                    config.epochs, epochs_done=0.0)
    return model, keras, schedule


def output_keys(model) -> Optional[List[str]]:
    """The names a dict of labels or losses may key: a functional model's outputs (the dict's keys,
    or the output layers' names); None where the model does not say (a subclassed model)."""
    struct = getattr(model, "_outputs_struct", None)  # Keras 3's
    if struct is None:
        struct = getattr(model, "_nested_outputs", None)  # Keras 2's
    names = list(getattr(model, "output_names", None) or [])
    if isinstance(struct, dict):
        return sorted(set(struct) | set(names))
    return names or None


def check_outputs(model, examples) -> None:
    """Labels and compiled losses keyed by outputs the model has, before any step runs.

    Raises:
        HvdtrainError: naming the label or loss key no output has, and the outputs there are.
    """
    keys = output_keys(model)
    if keys is None:
        return
    spec = examples.batch_spec()
    labels = spec[1] if len(spec) > 1 else None
    for what, given in (("labels", labels), ("loss", getattr(model, "loss", None))):
        unknown = sorted(set(given) - set(keys)) if isinstance(given, dict) else []
        if unknown:
            raise HvdtrainError(f"the {what} name output(s) {', '.join(map(repr, unknown))} that the model does not "
                                f"have (its outputs: {', '.join(keys)})")


def first_batch(data) -> tuple:
    """A real local batch of this rank (the plan's first), for the probe step."""
    examples = data.dataset
    if isinstance(examples, StreamedExamples):
        batches, _ = examples.train_batches(data.plan, 0)
        return next(iter(batches))
    _, indices, _ = next(data.plan.epoch(0))
    return examples.rows(indices)


def build_step(ctx: DistContext, parts, model, data, schedule) -> OwnStep:
    """Step 4 on this path: every optimizer of the model through one :class:`GradientExchange`,
    then the probe step (:func:`~hvdtrain.keras_step.probe`) on a real batch.

    Raises:
        FoundHere / PeerFailure: for a model that holds no optimizer, or a step that fails.
    """
    def prepare():
        optimizers = model_optimizers(model)
        if not optimizers:
            raise HvdtrainError(f"{type(model).__name__} holds no optimizer: compile it with one, or give "
                                f"hvdtrain.fit optimizer=")
        check_outputs(model, data.dataset)
        exchange = GradientExchange(ctx.size)
        try:
            for optimizer in optimizers:
                exchange.wrap(optimizer)
            with tf.device(ctx.device):
                try:
                    logs = probe(model, exchange, first_batch(data))
                except HvdtrainError as e:
                    raise HvdtrainError(f"{e}{_padding_hint(data.dataset.structure)}") from e.__cause__
            optimizers = exchange.used()
            if not optimizers:
                raise HvdtrainError(f"{step_name(model)} applied no optimizer on a first batch: nothing would train")
        except BaseException:
            exchange.restore()  # the caller's optimizers update by themselves again
            raise
        objective = MetricSums(model, ctx.size)
        objective.add_extras(logs)
        return OwnStep(exchange, optimizers, objective, schedule, step_name(model), has_own_step(model))

    return ctx.guarded("running the model's first step", prepare)
