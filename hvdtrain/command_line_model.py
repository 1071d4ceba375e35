"""A Keras model object from the command line: ``--model package.module:name``, where ``name`` is a
model object or a function of no arguments that returns one (built, compiled as for Keras' ``fit``,
or with its own ``train_step``). It trains by its own step (:mod:`hvdtrain.keras_recipe`) on the
configured data in Keras' forms:

* in memory (``--dataset idx``, ``npz``, ``synthetic``): ``(x_train, y_train)`` and
  ``(x_test, y_test)`` as the files hold them (uint8 pixels stay uint8: scale them in the model);
* ``--data package.module:function``: the data function (:mod:`hvdtrain.data.function`) called
  once per split (``epoch=0``), returning unbatched examples ``(x[, y[, sample_weight]])`` of any
  structure; hvdtrain shuffles each epoch (``--shuffle-buffer``) and shards them exactly.

It trains as compiled: the command line's ``--loss``, ``--metrics`` and optimizer flags are for
hvdtrain's image step. A function with parameters is a build function ``fn(input_shape,
num_classes)``, trained by hvdtrain's image step as before.
"""
from __future__ import annotations

import dataclasses
import inspect
import tensorflow as tf

from hvdtrain import kerases
from hvdtrain.config import Config
from hvdtrain.data.examples import Examples, StreamedExamples
from hvdtrain.errors import HvdtrainError
from hvdtrain.keras_recipe import is_compiled, is_model_object
from hvdtrain.keras_step import has_own_step
from hvdtrain.runtime.dist import DistContext
from hvdtrain.user_code import import_function


def _makes_a_model(obj) -> bool:
    """A model object, or a function of no parameters at all; a build function (``input_shape``,
    ``num_classes``, defaults or not, or ``**kwargs``) and a class are not."""
    if is_model_object(obj):
        return True
    if not inspect.isfunction(obj):
        return False
    return not inspect.signature(obj).parameters


def _model(ctx: DistContext, spec: str, found) -> object:
    if is_model_object(found):
        return found
    try:
        with tf.device(ctx.device):
            model = found()
    except Exception as e:  # noqa: BLE001 -- the user's code: any error becomes one clear message
        raise HvdtrainError(f"--model {spec!r}: the function raised {type(e).__name__}: {e}") from None
    if not is_model_object(model):
        raise HvdtrainError(f"--model {spec!r}: the function returned {type(model).__name__}, not a Keras model "
                            f"(a build function takes input_shape and num_classes)")
    return model


def _check_compiled(spec: str, model) -> None:
    if not is_compiled(model) and not has_own_step(model):
        raise HvdtrainError(f"--model {spec!r}: the model is not compiled: compile it in your code (its loss, "
                            f"metrics, optimizer); the command line's --loss, --metrics and optimizer flags are "
                            f"for hvdtrain's image step")


def _examples(ctx: DistContext, config: Config):
    data = config.data
    if data.dataset == "function":
        return StreamedExamples.of_function(import_function(data.function, "--data"), f"--data {data.function!r}",
                                            ctx.rank, ctx.size, config.seed, data.shuffle_buffer)
    if data.dataset in ("tfrecord", "folder"):
        raise HvdtrainError(f"--dataset {data.dataset} with a Keras model object (--model {config.model.name!r}): "
                            f"give --data package.module:function returning its unbatched (x, y) examples")
    from hvdtrain.data.in_memory import load_dataset

    loaded = load_dataset(data.dataset, data.data_dir, config.seed, labels=None)
    return Examples((loaded.x_train, loaded.y_train), (loaded.x_test, loaded.y_test), name=loaded.name)


def command_line_parts(ctx: DistContext, config: Config, parts):
    """``parts`` with the model object ``--model`` names and its data as examples, or None where
    ``--model`` is a built-in model or a build function (or the caller gave its own parts).

    A collective: every rank imports and builds alike, and all fail together.

    Raises:
        FoundHere / PeerFailure: for a model or data that cannot be made (:meth:`DistContext.guarded`).
    """
    spec = config.model.name
    if ":" not in spec or any(v is not None for v in (parts.model, parts.dataset, parts.data_function,
                                                       parts.examples)):
        return None
    found = ctx.guarded("importing --model", lambda: import_function(spec, "--model"))
    if not _makes_a_model(found):
        return None
    kerases.set_random_seed(config.seed)  # any weights: rank 0's are broadcast; the same for the same seed
    model = ctx.guarded("building the model", lambda: _model(ctx, spec, found))
    ctx.guarded("checking the model", lambda: _check_compiled(spec, model))
    examples = ctx.guarded("reading the data", lambda: _examples(ctx, config))
    return dataclasses.replace(parts, model=model, examples=examples)

