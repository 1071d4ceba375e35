"""The Python API: :func:`fit` trains with hvdtrain's recipe from a script that every rank runs.

    # train.py -- horovodrun -np 4 python train.py
    import hvdtrain

    result = hvdtrain.fit(my_model, (x_train, y_train, x_test, y_test), loss="sparse_categorical_crossentropy",
                          metrics=["accuracy", "top5"], epochs=5, batch_size=64, optim={"base_lr": 0.05})
    print(result.history[-1]["test_accuracy"])

It is the command line's run (:func:`hvdtrain.recipe.run`) with the caller's own parts: the same
sharding, synchronized BatchNorm, learning-rate scaling, broadcast, exact metrics, checkpoints
and fail-fast; ``python -m hvdtrain`` is this with every part named by a flag.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Callable, List, Optional, Sequence, Union

from hvdtrain import callbacks as cbs
from hvdtrain.config import Config
from hvdtrain.config_file import config_from_flat, flatten, read_config_file
from hvdtrain.data.in_memory import Dataset, validate
from hvdtrain.ending import leave
from hvdtrain.errors import Ending, HvdtrainError, PeerFailure, RunEnded
from hvdtrain.user_code import name_of
from hvdtrain.runtime.signals import install_stop_handlers


@dataclasses.dataclass
class FitResult:
    """What :func:`fit` returns on every rank.

    Attributes:
        model: the trained Keras model (the same weights on every rank).
        history: one dict of global metrics per epoch trained in this call, in order
            (``train_loss``, ``train_<metric>``, ``test_loss``, ``test_<metric>``, ``lr``,
            ``images_per_sec``...); empty if there was nothing left to train.
        metrics: the final metrics: the last epoch's, or the test set's if nothing was trained.
        config: the resolved :class:`~hvdtrain.config.Config` of the run.
        rank: this process's rank (``is_chief``: rank 0, the one to print or save from).
    """

    model: object
    history: List[dict]
    metrics: dict
    config: Config
    rank: int = 0

    @property
    def is_chief(self) -> bool:
        return self.rank == 0


def fit(model_fn: Union[str, Callable], data=None, *, loss=None, metrics: Optional[Sequence] = None,
        optimizer=None, config: Union[Config, dict, str, None] = None, callbacks: Sequence = (),
        convert_sync_bn: bool = False, x=None, y=None, sample_weight=None, class_weight=None,
        validation_data=None, loss_weights=None, **settings) -> FitResult:
    """Train the model of ``model_fn`` on ``data`` with data-parallel ranks; every rank of the job
    calls it alike.

    Args:
        model_fn: a Keras model object (built or compiled, Keras 2 or 3), which trains by its own
            ``train_step`` -- Keras' default, or the model's -- on data in any form Keras' ``fit``
            takes (the arguments ``x`` to ``loss_weights`` below; see docs/python-api.md); or a
            built-in model's name (``cnn``, ``resnet20``, ``unet``) or a function called as
            ``model_fn(input_shape=(H, W, C), num_classes=K)`` returning an uncompiled Keras model,
            Keras 2 (``tf.keras``, ``tf_keras``) or Keras 3 (``import keras``; use
            ``hvdtrain.keras2.SyncBatchNormalization``, resp. ``hvdtrain.keras3.SyncBatchNormalization``,
            or ``convert_sync_bn=True`` for synchronized batch statistics); its outputs must fit
            the labels (checked first). The model's Keras is the run's: the optimizer, a Keras
            loss and Keras callbacks must be of the same one.
        data: the same on every rank. In memory: ``(x_train, y_train, x_test, y_test)`` numpy
            arrays -- images ``(n, H, W[, C])`` uint8 (pixels 0-255) or float, labels ``(n, ...)``
            (int class indices, per image or per pixel; or float targets) -- or a
            :class:`~hvdtrain.data.in_memory.Dataset`. Streamed: ``(train, test)``, two
            ``tf.data.Dataset`` of unbatched ``(image, label)`` pairs (class labels), which each
            epoch shuffles alike on every rank (``data={"shuffle_buffer": N}``) and shards exactly;
            or a data function ``fn(split, rank, world_size, seed, epoch) -> tf.data.Dataset``
            (:mod:`hvdtrain.data.function`). None: the config's ``data`` section (files, streams).
            For a model object, each part any nest (dicts of features, labels per output,
            ``(x, y, sample_weight)`` elements), and a data function is called once per split.
        loss: ``sparse_categorical_crossentropy``, ``binary_crossentropy``, ``mse``, a
            Keras ``losses.Loss`` or a callable ``(labels, outputs) -> (b, ...)`` losses per
            example or element (:func:`hvdtrain.losses.get_loss`); None: the config's.
        metrics: names (``accuracy``, ``top5``, ``mean_iou``), :class:`~hvdtrain.metrics.Metric`
            objects or callables ``(labels, outputs) -> (b,)`` values averaged over examples;
            every one exact over all ranks. None: the config's.
        optimizer: ``sgd``, ``adam``, ``adamw`` (hvdtrain's, on its warmup schedule scaled by
            world size: ``optim={...}`` sets it up), or your own Keras optimizer (Keras 2 or 3),
            whose learning rate or ``LearningRateSchedule`` is used as it is, not scaled. Either
            way Horovod averages the gradients by allreduce before the update. None: the config's.
        config: a :class:`~hvdtrain.config.Config`, a mapping of its settings as a run file nests
            them (``{"optim": {"base_lr": 0.1}}``), or a run file's path (YAML); None: defaults.
        callbacks: :class:`~hvdtrain.callbacks.Callback` objects (those with ``chief_only`` run
            on rank 0 only), and Keras ``callbacks`` ones -- ``EarlyStopping``,
            ``ReduceLROnPlateau``, ``ModelCheckpoint``, ``CSVLogger``, ``TerminateOnNaN``,
            ``LambdaCallback``, ``LearningRateScheduler``, your own -- which see the global metrics
            under Keras' names (:mod:`hvdtrain.keras_callbacks`).
        convert_sync_bn: replace the model's Keras ``BatchNormalization`` layers by synchronized
            ones (:func:`hvdtrain.convert_sync_batchnorm`).
        x, y, sample_weight, class_weight, validation_data: for a model object, as Keras' ``fit``
            takes them (``data`` left out): features and labels any nest of arrays (dicts, lists;
            any dtype: token ids, strings, floats; ``tf.RaggedTensor`` rows padded per batch).
            ``data`` may then also be ``(x_train, y_train, x_test, y_test)`` of such nests, or
            ``(train, test)`` datasets of unbatched ``(x[, y[, sample_weight]])`` (``test`` None: no
            evaluation).
        loss_weights: for an uncompiled model object, ``compile``'s ``loss_weights``.
        **settings: settings over ``config``, as its mapping names them (``epochs=5``,
            ``batch_size=64``, ``optim={"base_lr": 0.1}``, ``model={"sync_bn": False}``).

    Returns:
        A :class:`FitResult`, on every rank.

    Raises:
        HvdtrainError: for bad settings, data, model, loss or metrics, or a failure of training
            that every rank met: with its message where this rank has it (the rank that found it,
            or every rank for an error alike on all), else saying that another rank reports it.

    Exits:
        the process, as the command line's run does (printing the same line, with its exit
        status), where this rank must leave at once: on Ctrl-C or SIGTERM, and on an error of its
        own while the other ranks wait in a collective, so that no rank hangs in Horovod's shutdown.
    """
    from hvdtrain.keras_recipe import is_model_object

    keras_forms = dict(x=x, y=y, sample_weight=sample_weight, class_weight=class_weight,
                       validation_data=validation_data, loss_weights=loss_weights)
    if is_model_object(model_fn):
        return _fit_model_object(model_fn, data, keras_forms, loss, metrics, optimizer, config, callbacks,
                                 convert_sync_bn, settings)
    given = [k for k, v in keras_forms.items() if v is not None]
    if given:
        raise HvdtrainError(f"hvdtrain.fit: {', '.join(given)} are for a Keras model object; a build function or "
                            f"built-in model takes data=(x_train, y_train, x_test, y_test)")
    # Parts given by name are settings: the run's config.yaml and checkpoints record them.
    settings = dict(settings)
    model_settings, task = dict(settings.pop("model", {})), dict(settings.pop("task", {}))
    if isinstance(model_fn, str):
        model_settings["name"], model_fn = model_fn, None
    if isinstance(loss, str):
        task["loss"], loss = loss, None
    if isinstance(metrics, str) or callable(metrics):
        metrics = [metrics]
    if metrics is not None and all(isinstance(m, str) for m in metrics):
        task["metrics"], metrics = ",".join(metrics), None
    if isinstance(optimizer, str):
        settings["optim"], optimizer = {**settings.get("optim", {}), "name": optimizer}, None
    if convert_sync_bn:
        model_settings["convert_sync_bn"] = True
    data_function = streamed_data(data)
    if data_function is not None:  # recorded in the run's config.yaml by the function's name
        settings["data"] = {**settings.get("data", {}), "dataset": "function", "function": data_function[2]}
    run_config = resolve_config(config, {**settings, **({"model": model_settings} if model_settings else {}),
                                         **({"task": task} if task else {})})
    from hvdtrain.losses import get_loss
    from hvdtrain.recipe import run
    from hvdtrain.recipe_steps import Parts

    # Arrays are read as the loss takes its labels (class indices or targets).
    labels = get_loss(run_config.task.loss if loss is None else loss, run_config.task.label_smoothing).labels
    dataset = None if data_function is not None else as_dataset(data, labels)
    if data_function is not None and data_function[0] is None:  # (train, test) datasets
        from hvdtrain.data.function import datasets_function

        data_function = (datasets_function(*data, run_config.data.shuffle_buffer), *data_function[1:])
    if threading.current_thread() is threading.main_thread():  # Python's rule for signal handlers
        install_stop_handlers()  # a launcher's Ctrl-C (SIGTERM) stops every rank cleanly

    history = cbs.History()
    parts = Parts(model=model_fn, dataset=dataset, loss=loss, metrics=metrics, callbacks=[*callbacks, history],
                  optimizer=optimizer, data_function=data_function[:2] if data_function else None)
    try:
        outcome = run(run_config, parts, keep_horovod=True)
    except RunEnded as ended:
        raise _raised(ended) from ended.cause
    return FitResult(outcome.model, history.history, outcome.metrics, run_config, outcome.rank)


def _fit_model_object(model, data, forms: dict, loss, metrics, optimizer, config, callbacks, convert_sync_bn,
                      settings: dict) -> FitResult:
    """:func:`fit` for a Keras model object: its own step, on data in Keras' forms (:mod:`hvdtrain.keras_recipe`)."""
    from hvdtrain.keras_recipe import examples_from
    from hvdtrain.recipe import run
    from hvdtrain.recipe_steps import Parts

    settings = dict(settings)
    if convert_sync_bn:
        settings["model"] = {**settings.get("model", {}), "convert_sync_bn": True}
    run_config = resolve_config(config, settings)
    if isinstance(metrics, str) or callable(metrics):
        metrics = [metrics]
    loss_weights = forms.pop("loss_weights")
    if data is not None and forms["validation_data"] is not None:
        raise HvdtrainError("hvdtrain.fit: validation_data= with data=: give the test split in data, or use "
                            "x=, y=, validation_data=")
    examples = examples_from(data, **forms, shuffle_buffer=run_config.data.shuffle_buffer, seed=run_config.seed)
    if threading.current_thread() is threading.main_thread():
        install_stop_handlers()
    history = cbs.History()
    parts = Parts(model=model, examples=examples, loss=loss, metrics=metrics, optimizer=optimizer,
                  callbacks=[*callbacks, history], loss_weights=loss_weights)
    try:
        outcome = run(run_config, parts, keep_horovod=True)
    except RunEnded as ended:
        raise _raised(ended) from ended.cause
    return FitResult(outcome.model, history.history, outcome.metrics, run_config, outcome.rank)


def resolve_config(config: Union[Config, dict, str, None], settings: dict) -> Config:
    """The :class:`Config` of ``config`` with ``settings`` over it (see :func:`fit`).

    Raises:
        HvdtrainError: naming an unknown key, a value of the wrong type or out of its range.
    """
    if isinstance(config, str):
        flat = read_config_file(config)
    elif isinstance(config, Config):
        flat = flatten(config.to_dict(), "hvdtrain.fit(config=...)")
    elif isinstance(config, dict) or config is None:
        flat = flatten(config or {}, "hvdtrain.fit(config=...)")
    else:
        raise HvdtrainError(f"hvdtrain.fit(config=...) takes a Config, a mapping or a run file's path, got "
                            f"{type(config).__name__}")
    return config_from_flat({**flat, **flatten(settings, "hvdtrain.fit(...)")})


def streamed_data(data) -> Optional[tuple]:
    """For ``data`` that :func:`fit` streams: ``(function, what messages call it, its name in the
    run's config)``, the function None for ``(train, test)`` datasets (made with the run's
    shuffle buffer); None for anything else.

    Raises:
        HvdtrainError: for one ``tf.data.Dataset`` alone (a training set needs its test set).
    """
    import tensorflow as tf

    if isinstance(data, tf.data.Dataset):
        raise HvdtrainError("hvdtrain.fit(data=...) got one tf.data.Dataset; pass (train, test): two datasets of "
                            "unbatched (image, label) pairs")
    if isinstance(data, (tuple, list)) and len(data) == 2 and any(isinstance(d, tf.data.Dataset) for d in data):
        return None, "hvdtrain.fit(data=(train, test))", "tf.data:(train, test)"
    if callable(data) and not isinstance(data, Dataset):
        name = f"{getattr(data, '__module__', None) or 'data'}:{getattr(data, '__qualname__', type(data).__name__)}"
        return data, f"hvdtrain.fit(data={name_of(data)})", name
    return None


def as_dataset(data, labels: Optional[str]) -> Optional[Dataset]:
    """``data`` as a validated :class:`Dataset` of ``labels`` (``"classes"``, ``"targets"`` or None:
    by their dtype); None stays None (the config's data).

    Raises:
        HvdtrainError: for anything but a Dataset or four arrays, or arrays :func:`validate` refuses.
    """
    if data is None or isinstance(data, Dataset):
        return data
    if not isinstance(data, (tuple, list)) or len(data) != 4:
        raise HvdtrainError(f"hvdtrain.fit(data=...) takes (x_train, y_train, x_test, y_test) arrays, (train, test) "
                            f"tf.data datasets, a data function or an hvdtrain Dataset, got {type(data).__name__}"
                            + (f" of {len(data)}" if isinstance(data, (tuple, list)) else ""))
    import numpy as np

    x_train, y_train, x_test, y_test = (np.asarray(array) for array in data)
    x_train, x_test = (x[..., None] if x.ndim == 3 else x for x in (x_train, x_test))
    if labels != "targets" and y_train.ndim == 2 and y_train.shape[1] == 1 and np.issubdtype(y_train.dtype, np.integer):
        y_train, y_test = y_train[:, 0], y_test.reshape(len(y_test), -1)[:, 0]  # keras.datasets' (n, 1) classes
    return validate(x_train, y_train, x_test, y_test, name="arrays", labels=labels)


def _raised(ended: RunEnded) -> BaseException:
    """The exception :func:`fit` raises for how this rank leaves, or the process exits here."""
    if ended.ending in (Ending.ALONE, Ending.INTERRUPTED, Ending.TERMINATED):
        leave(ended)  # exits the process
    if ended.ending is Ending.QUIET:
        if ended.message:
            return HvdtrainError(ended.message)
        if isinstance(ended.cause, (HvdtrainError, PeerFailure)):  # "rank 0 failed while loading data"
            return HvdtrainError(f"{ended.cause}; that rank reports why")
        return HvdtrainError("the run failed on another rank, which reports why")
    if ended.traceback:
        return ended.cause
    message = ended.message or str(ended)
    return HvdtrainError(message[len("hvdtrain: error: "):] if message.startswith("hvdtrain: error: ") else message)
