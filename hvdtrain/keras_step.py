"""A Keras model's own step on every rank: Keras' default ``train_step`` or the model's, exact over ranks.

Keras puts distribution between a step's gradients and its update (the optimizer's
``apply``); hvdtrain puts Horovod there (:class:`GradientExchange`). Every optimizer the model
holds -- ``model.optimizer``, or a GAN's two -- has its ``apply`` (Keras 3) or
``apply_gradients`` (Keras 2) wrapped so that, before the update, each rank's gradients are
scaled by ``local count / global count`` and summed over ranks by one grouped allreduce. For a
loss that is a mean over the batch (Keras' default reduction, with or without sample weights,
plus ``model.losses``) that is the gradient of the global batch's loss, exactly, also when the
ranks' local batches differ (the last step of an epoch). A step whose loss is no batch mean is
trained as Keras' own ``tf.distribute`` would train it, not necessarily as one process would.

Metrics stay exact because every Keras metric keeps sums (totals, counts, confusion matrices):
:class:`MetricSums` reads the model's metric variables as one float64 vector, which the trainer
allreduces (:mod:`hvdtrain.trainer`), and computes the results from the global sums. What a
step returns besides its metrics is averaged over ranks (the last step's value).

Reference: Keras 3 ``TensorFlowTrainer.train_step`` and ``optimizer.apply``; Goyal et al. 2017,
"Accurate, Large Minibatch SGD" (summed, count-weighted gradients).
"""
from __future__ import annotations

import contextlib
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from hvdtrain.data.examples import batch_size_of, gather_rows
from hvdtrain.errors import EveryRankError, HvdtrainError
from hvdtrain.exchange import Exchange
from hvdtrain.model.fused_bn import fuse_keras3_batch_norm
from hvdtrain.runtime.dist import tf_variable


def is_optimizer(obj) -> bool:
    """A Keras 2 or 3 optimizer (duck-typed: ``apply_gradients`` and ``iterations``)."""
    return not isinstance(obj, type) and hasattr(type(obj), "apply_gradients") and hasattr(obj, "iterations")


def _own(model, method: str) -> Optional[str]:
    """The class that defines ``method`` for ``model``, where it is not Keras' own."""
    for cls in type(model).__mro__:
        if method in vars(cls):
            return None if cls.__module__.split(".")[0] in ("keras", "tf_keras") else cls.__name__
    return None


def has_own_step(model) -> bool:
    """Whether ``model`` brings its own ``train_step`` or ``compute_loss``."""
    return bool(_own(model, "train_step") or _own(model, "compute_loss"))


def step_name(model) -> str:
    """What trains: the model's own ``train_step``, Keras' default with the model's own
    ``compute_loss``, or Keras' default (the only one that is exact whatever the model computes)."""
    if _own(model, "train_step"):
        return f"{_own(model, 'train_step')}.train_step (the model's own)"
    if _own(model, "compute_loss"):
        return f"Keras' default train_step with {_own(model, 'compute_loss')}.compute_loss (the model's own)"
    return "Keras' default train_step"


def model_optimizers(model) -> list:
    """Every optimizer ``model`` holds: ``model.optimizer``, then any other attribute that is one
    (a GAN's ``d_optimizer`` and ``g_optimizer``), each once, in that order."""
    found = []
    for value in [getattr(model, "optimizer", None), *vars(model).values()]:
        if is_optimizer(value) and all(value is not seen for seen in found):
            found.append(value)
    return found


class GradientExchange:
    """Sums the gradients of every wrapped optimizer over ranks before its update.

    Args:
        world_size: ranks; at 1 the gradients are only scaled (by 1 where the batch is whole).

    Attributes:
        share: float64 scalar variable, this rank's ``local count / global count`` for the step
            now running (the trainer sets it before each step); float64, so that a float64 model's
            step stays exact, and cast to each gradient's dtype.

    The exchange of one ``apply``: gradients ``None`` pass as they are (alike on every rank: the
    same model); every other one times ``share``, summed over ranks by :class:`hvdtrain.exchange.Exchange`
    (dense ones in fixed buckets, ``IndexedSlices`` the cheaper of allgather and dense allreduce).
    """

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.share = tf.Variable(1.0, trainable=False, dtype=tf.float64, name="hvdtrain_batch_share")
        self._wrapped: List[Tuple[object, str, Callable]] = []
        self._used: list = []
        self._dry = False
        self._sum = Exchange(average=False)

    def exchange(self, gradients: Sequence, variables: Optional[Sequence] = None) -> list:
        """``gradients`` (one per variable, any may be None) scaled by :attr:`share`, summed over ranks
        (``variables``, where given, give the shapes a gradient may lack: :class:`hvdtrain.exchange.Exchange`)."""
        scaled = [None if g is None else _times(g, self.share) for g in gradients]
        if self.world_size == 1:
            return scaled
        return self._sum(scaled, variables)

    def wrap(self, optimizer) -> None:
        """Route ``optimizer``'s updates through :meth:`exchange` (until :meth:`restore`)."""
        keras3 = hasattr(optimizer, "stateless_apply")
        name = "apply" if keras3 else "apply_gradients"
        original = getattr(optimizer, "_hvdtrain_unwrapped", None) or getattr(optimizer, name)
        exchange = self

        if keras3:
            def apply(grads, trainable_variables=None):
                if exchange._dry:
                    return exchange._build(optimizer, trainable_variables)
                return original(exchange.exchange(grads, trainable_variables), trainable_variables)
            wrapped = apply
        else:
            def apply_gradients(grads_and_vars, *args, **kwargs):
                pairs = list(grads_and_vars)
                variables = [v for _, v in pairs]
                if exchange._dry:
                    return exchange._build(optimizer, variables)
                return original(list(zip(exchange.exchange([g for g, _ in pairs], variables), variables)), *args, **kwargs)
            wrapped = apply_gradients
        object.__setattr__(optimizer, name, wrapped)
        object.__setattr__(optimizer, "_hvdtrain_unwrapped", original)
        self._wrapped.append((optimizer, name, original))

    def _build(self, optimizer, variables) -> None:
        """Create the optimizer's slots for ``variables`` without an update (:meth:`dry`), and
        count it among the :meth:`used` ones."""
        if all(optimizer is not seen for seen in self._used):
            self._used.append(optimizer)
        if hasattr(optimizer, "stateless_apply"):
            if not optimizer.built:
                optimizer.build(variables)
        elif hasattr(optimizer, "_create_all_weights"):  # Keras 2's legacy optimizers
            optimizer._create_all_weights(variables)  # pylint: disable=protected-access
        else:
            optimizer.build(variables)

    def used(self) -> list:
        """The optimizers the probe step applied, in the order it applied them; the others (Keras'
        default ``rmsprop`` of a GAN's ``compile()``, never stepped) are given back unwrapped."""
        for wrapped in list(self._wrapped):
            if all(wrapped[0] is not seen for seen in self._used):
                _unwrap(*wrapped)
                self._wrapped.remove(wrapped)
        return list(self._used)

    @contextlib.contextmanager
    def dry(self):
        """Inside, a wrapped ``apply`` builds the optimizer's slots and updates nothing (the probe step)."""
        self._dry = True
        try:
            yield
        finally:
            self._dry = False

    def restore(self) -> None:
        """Give every wrapped optimizer its own update back (``fit`` returns a plain model)."""
        for wrapped in reversed(self._wrapped):
            _unwrap(*wrapped)
        self._wrapped.clear()


def _times(gradient, share: tf.Variable):
    """``gradient`` (dense or ``IndexedSlices``) times ``share``, cast to its dtype."""
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values * tf.cast(share, gradient.values.dtype), gradient.indices,
                                gradient.dense_shape)
    gradient = tf.convert_to_tensor(gradient)
    return gradient * tf.cast(share, gradient.dtype)


def _unwrap(optimizer, name: str, original: Callable) -> None:
    """``optimizer``'s method ``name`` as it was before :meth:`GradientExchange.wrap`."""
    optimizer.__dict__.pop(name, None)
    optimizer.__dict__.pop("_hvdtrain_unwrapped", None)
    if getattr(optimizer, name) != original:  # an instance attribute of the user's own
        object.__setattr__(optimizer, name, original)


def _flat_logs(logs) -> dict:
    """A step's returned logs as ``{name: scalar tensor}`` (nested dicts flattened, as Keras' fit does)."""
    out = {}
    for key, value in dict(logs or {}).items():
        if isinstance(value, dict):
            out.update(_flat_logs(value))
        else:
            out[key] = value
    return out


class MetricSums:
    """The model's metrics as one float64 sums vector ``[examples, *metric variables, *extras]``.

    Args:
        model: the compiled (and probed: :func:`probe`) Keras model; its metric variables hold
            sums (totals, counts, confusion matrices), as every Keras metric's do, accumulated by
            Keras in their own dtype (float32) within an epoch and read as float64 for the
            allreduce; zeros are their reset state.
        world_size: ranks (what the step returns besides its metrics is their sum / world_size).

    The trainer's protocol (as :class:`hvdtrain.task.Objective`'s): ``size``, ``layout``,
    :meth:`results`, :meth:`start_sums`, :meth:`examples`; and :meth:`load`, :meth:`read`.
    """

    def __init__(self, model, world_size: int = 1):
        self.model, self.world_size = model, world_size
        owned = [(m.name, tf_variable(v)) for m in model.metrics for v in m.variables]
        self.variables = [v for _, v in owned]
        self.shapes = [tuple(v.shape) for v in self.variables]
        self._names = [f"{metric}/{v.name}" for metric, v in owned]  # Keras 2 names them total:0, count:0 alone
        self.extras: List[str] = []
        self.examples_seen = tf.Variable(0.0, dtype=tf.float64, trainable=False, name="hvdtrain_examples")
        results = self.metric_results(scalars_only=False)
        self.names = [k for k, v in results.items() if np.asarray(v).size == 1]
        self._all_names = set(results)

    def add_extras(self, logs: dict) -> None:
        """Also carry what the step returns besides its metrics' results: each scalar (the last
        step's value, averaged over ranks)."""
        self.extras += [k for k, v in logs.items() if k not in self._all_names and np.asarray(v).size == 1]

    @property
    def size(self) -> int:
        return 1 + sum(int(np.prod(s)) for s in self.shapes) + len(self.extras)

    @property
    def layout(self) -> Tuple[str, ...]:
        return tuple(f"{n}:{int(np.prod(s))}" for n, s in zip(self._names, self.shapes)) + tuple(self.extras)

    def read(self, logs: Optional[dict] = None) -> tf.Tensor:
        """float64 ``(size,)``: the sums now (inside a compiled step, with its returned ``logs``)."""
        parts = [tf.reshape(self.examples_seen, [1])]
        parts += [tf.reshape(tf.cast(v, tf.float64), [-1]) for v in self.variables]
        flat = _flat_logs(logs)
        parts += [tf.reshape(tf.cast(flat[k], tf.float64), [1]) if logs is not None else tf.zeros([1], tf.float64)
                  for k in self.extras]
        return tf.concat(parts, 0)

    def load(self, values) -> None:
        """Set the examples count and every metric variable from a sums vector (eager)."""
        values = np.asarray(values, np.float64)
        self.examples_seen.assign(values[0])
        offset = 1
        for variable, shape in zip(self.variables, self.shapes):
            n = int(np.prod(shape))
            variable.assign(values[offset:offset + n].reshape(shape).astype(variable.dtype.as_numpy_dtype))
            offset += n

    def metric_results(self, scalars_only: bool = True) -> dict:
        """``{name: float}`` of the model's scalar metrics as they stand (Keras' own ``result()``);
        ``scalars_only=False``: every result, a vector one (``F1Score(average=None)``) as an array."""
        get = getattr(self.model, "get_metrics_result", None)
        results = {k: np.asarray(v) for k, v in _flat_logs(get() if get is not None else {
            m.name: m.result() for m in self.model.metrics}).items()}
        if not scalars_only:
            return results
        return {k: float(v) for k, v in results.items() if v.size == 1}

    def results(self, sums) -> dict:
        """``{metric: value, extra: mean over ranks, "count": examples}`` from global sums."""
        sums = np.asarray(sums, np.float64)
        saved = self.read().numpy()
        self.load(sums)
        try:
            out = self.metric_results()
        finally:
            self.load(saved)
        tail = sums[self.size - len(self.extras):]
        out.update({k: float(v) / self.world_size for k, v in zip(self.extras, tail)})
        out["count"] = int(sums[0])
        return out

    @staticmethod
    def examples(sums) -> float:
        return float(np.asarray(sums)[0])

    def start_sums(self, position=None) -> np.ndarray:
        """An epoch's sums so far: a resumed mid-epoch position's, or zeros.

        Raises:
            EveryRankError: for sums of other metrics (another model's checkpoint).
        """
        sums = position.epoch_sums if position is not None else None
        if not sums:
            return np.zeros(self.size)
        if len(sums) != self.size or (position.sums_layout is not None and tuple(position.sums_layout) != self.layout):
            raise EveryRankError("the checkpoint, mid-epoch, holds the sums of other metrics than this model's: "
                                 "resume with the model and metrics of the run that wrote it")
        return np.asarray(sums, np.float64)


def separate_random_streams(model, seed: int, rank: int) -> None:
    """After the broadcast of rank 0's state: each rank draws its own random numbers (Dropout's
    masks, a GAN's noise), as the ranks' examples differ, instead of rank 0's on every rank.

    Keras 3 keeps each ``SeedGenerator``'s ``[seed, counter]`` among the model's variables (the
    broadcast copied rank 0's): rank ``r`` adds ``r * 1_000_003`` to the seed. Keras 2's unseeded
    random ops take their seeds from TensorFlow's global seed when traced: it becomes
    ``seed * 1_000_003 + rank``. Rank 0 draws what one process would.
    """
    tf.random.set_seed(seed * 1_000_003 + rank)
    offset_seed_generators(model.variables, rank)


def offset_seed_generators(variables, rank: int) -> None:
    """Rank ``r`` adds ``r * 1_000_003`` to the seed of each Keras 3 ``SeedGenerator`` state among
    ``variables`` (after a broadcast copied rank 0's to every rank); rank 0's stay."""
    if not rank:
        return
    for variable in variables:
        if "seed_generator_state" in getattr(variable, "path", variable.name):
            state = np.array(variable.numpy())
            state[0] += rank * 1_000_003
            variable.assign(state)


def built_variables(model) -> list:
    """``model.variables``, or ``[]`` for a Keras 2 model not built yet (it raises): its first step builds it."""
    try:
        return list(model.variables)
    except ValueError:
        return []


def probe(model, exchange: GradientExchange, batch: tuple) -> dict:
    """Run the model's ``train_step`` once, eagerly, on a real local ``batch`` with no update: it
    builds what Keras builds at a first step (the model itself if it is not built, the compiled
    loss and metrics, every optimizer's slots) so that all of it can be broadcast and checkpointed,
    and a step that fails is named here. The variables the model had are as before (one it builds
    here keeps what the forward pass wrote: BatchNorm's first moving statistics; rank 0's are
    broadcast); its metrics are reset.

    Returns:
        The step's logs, ``{name: value}`` (NumPy arrays).

    Raises:
        HvdtrainError: naming the model's step and the error it raised.
    """
    before = {id(v): v.numpy() for v in built_variables(model)}
    try:
        with exchange.dry():
            logs = model.train_step(batch)
    except HvdtrainError:
        raise
    except Exception as e:  # noqa: BLE001 -- the user's code: named as theirs
        first = (str(e).strip().splitlines() or [""])[0]
        raise HvdtrainError(f"{step_name(model)} fails on a batch of {int(batch_size_of(batch))} examples: "
                            f"{type(e).__name__}: {first}") from e
    for v in model.variables:
        if id(v) in before:
            v.assign(before[id(v)])
    for m in model.metrics:
        m.reset_state()
    return {k: np.asarray(v) for k, v in _flat_logs(logs).items()}


def per_batch_size(fn: Callable, specs: Callable) -> Callable:
    """``fn`` traced once per batch size ``b`` (of its first argument's first leaf), with the specs
    ``specs(b)``: Keras 3 weighs each output's loss metric by the batch's *static* size, which a
    ``None`` batch dimension would lose; other dimensions stay as ``specs`` gives them (a padded
    sequence's length varies without a trace). An epoch has at most three local batch sizes."""
    traced = {}

    def call(*args):
        b = int(tf.nest.flatten(args[0])[0].shape[0])
        if b not in traced:
            traced[b] = fn.get_concrete_function(*specs(b))
        return traced[b](*args)

    return call


def _with_batch(spec, b: int):
    return tf.nest.map_structure(lambda s: tf.TensorSpec([b, *s.shape.as_list()[1:]], s.dtype), spec)


def make_keras_steps(model, exchange: GradientExchange, objective: MetricSums, sums: tf.Variable, spec,
                     gather_from: Optional[tuple] = None) -> Tuple[Callable, Callable]:
    """This rank's compiled ``(train_step, eval_step)`` of the model's own ``train_step`` and ``test_step``.

    Args:
        spec: the ``tf.TypeSpec`` nest of one batch (``Examples.batch_spec``).
        gather_from: in memory, the training tensors: ``train_step`` is then called with int32
            ``(b,)`` indices into them, not with the batch.

    Returns:
        ``train_step(batch or indices, global_count)``: one step, the exchange's share set from the
        batch's rows and the float32 global count, ``sums`` set to :meth:`MetricSums.read`;
        ``eval_step(batch)``: the model's ``test_step`` (the metrics accumulate). Each is traced
        once per local batch size (:func:`per_batch_size`).
    """
    fuse_keras3_batch_norm(model)  # Keras 3's BatchNormalization through TensorFlow's fused kernel

    @tf.function
    def train_step(batch, global_count):
        data = gather_rows(gather_from, batch) if gather_from is not None else batch
        local = batch_size_of(data)
        exchange.share.assign(tf.cast(local, tf.float64) / tf.cast(global_count, tf.float64))
        logs = model.train_step(data)
        objective.examples_seen.assign_add(tf.cast(local, tf.float64))
        sums.assign(objective.read(logs))

    @tf.function
    def eval_step(batch):
        model.test_step(batch)
        objective.examples_seen.assign_add(tf.cast(batch_size_of(batch), tf.float64))

    scalar = tf.TensorSpec([], tf.float32)
    train_specs = ((lambda b: (tf.TensorSpec([b], tf.int32), scalar)) if gather_from is not None
                   else (lambda b: (_with_batch(spec, b), scalar)))
    return per_batch_size(train_step, train_specs), per_batch_size(eval_step, lambda b: (_with_batch(spec, b),))


def own_step_functions(model, own_step, examples, world_size: int, rank: int, in_memory: bool):
    """The trainer's parts for a model's own step (call under the rank's device): ``(sums,
    train_step, eval_step, test_tensors)``: the float64 sums variable, the compiled steps
    (:func:`make_keras_steps`) and, in memory, this rank's shard of the test set as tensors (else None)."""
    from hvdtrain.data.sharding import eval_shard

    sums = tf.Variable(tf.zeros(own_step.objective.size, tf.float64), trainable=False, name="epoch_sums")
    test = None
    if in_memory and examples.test is not None:
        mine = eval_shard(examples.num_test, world_size, rank)
        test = examples.on_device(tf.nest.map_structure(lambda a: a[mine], examples.test))
    train_step, eval_step = make_keras_steps(model, own_step.exchange, own_step.objective, sums,
                                             examples.batch_spec(), examples.on_device(examples.train) if in_memory
                                             else None)
    return sums, train_step, eval_step, test


def test_rows(tensors: tuple, batch_size: int):
    """Batches of up to ``batch_size`` rows of in-memory test tensors, in order."""
    n = int(tf.nest.flatten(tensors)[0].shape[0])
    for start in range(0, n, batch_size):
        yield gather_rows(tensors, tf.range(start, min(start + batch_size, n)))


def evaluate_locally(eval_step: Callable, objective: MetricSums, batches, beat: Callable) -> np.ndarray:
    """This rank's metric sums over ``batches`` (float64 ``(size,)``), from zeroed metrics."""
    objective.load(np.zeros(objective.size))
    for batch in batches:
        eval_step(batch)
        beat()
    return objective.read().numpy()
