"""Mixed precision: Keras' dtype policy for the model, and dynamic loss scaling agreed by every rank.

Under ``bf16`` and ``fp16`` the layers compute in the half type while variables, the loss and the
metrics stay float32 (Micikevicius et al. 2018, "Mixed Precision Training"). float16's narrow
range needs loss scaling: the loss is multiplied by a scale before the backward pass so small
gradients do not flush to zero, and the gradients are divided by it again before the allreduce.

Why every rank agrees on a skipped step without a collective of its own: the allreduce sums the
ranks' gradients, and a NaN or infinity on any rank makes the sum non-finite on every rank
(``inf + x = inf``, ``NaN + x = NaN``, ``inf - inf = NaN``), so each rank's finite-check of the
*allreduced* gradients gives the same answer. Each rank then skips or applies the same update and
moves the same scale the same way.
"""
from __future__ import annotations

import sys
from typing import List, Optional

import tensorflow as tf

from hvdtrain import kerases

POLICIES = {"fp32": "float32", "bf16": "mixed_bfloat16", "fp16": "mixed_float16", "fp64": "float64"}


_FLOATX_BEFORE_FP64 = {}  # Keras version -> its floatx before fp64 set it (restored by the next precision)


def set_precision(precision: str) -> None:
    """Set the global dtype policy of each Keras (2 and 3) for the layers built from now on: a
    model function's Keras is known only once it has built the model. ``fp64`` also sets Keras'
    ``floatx`` (what initializers and backend helpers default to) to float64, until another
    precision restores it. ``fp32`` is Keras' policy of its ``floatx``: the user's own
    ``keras.config.set_floatx("float64")`` stays in force.

    Args:
        precision: ``fp32``, ``bf16``, ``fp16`` or ``fp64`` (:data:`hvdtrain.config.PRECISIONS`).

    Raises:
        KeyError: for another name (the config refuses it first).
    """
    policy = POLICIES[precision]
    for version in (2, 3):
        if version == 3 and not kerases.keras3_installed():
            continue
        if precision == "fp32" and version == 3 and "keras" not in sys.modules:
            continue  # float32 is the default of a Keras not imported yet: importing it would cost a second
        try:
            keras = kerases.module(version)
            if precision == "fp64":
                _FLOATX_BEFORE_FP64.setdefault(version, keras.backend.floatx())
                keras.backend.set_floatx("float64")
            elif version in _FLOATX_BEFORE_FP64:
                keras.backend.set_floatx(_FLOATX_BEFORE_FP64.pop(version))
            keras.mixed_precision.set_global_policy(keras.backend.floatx() if precision == "fp32" else policy)
        except Exception:  # noqa: BLE001 -- a Keras not installed, or Keras 3 on another backend: not used here
            continue


def restore_floatx() -> None:
    """Give each Keras back the ``floatx`` it had before ``fp64`` set it (at a run's end: the
    user's code after ``hvdtrain.fit`` builds its models as before)."""
    for version, floatx in list(_FLOATX_BEFORE_FP64.items()):
        keras = kerases.module(version)
        keras.backend.set_floatx(_FLOATX_BEFORE_FP64.pop(version))
        keras.mixed_precision.set_global_policy(floatx)


class DynamicLossScale:
    """A loss scale that halves when the gradients overflow and doubles after a run of finite steps.

    The algorithm and defaults are Keras' ``LossScaleOptimizer`` (initial 2^15, growth every 2000
    finite steps, factor 2; Micikevicius et al. 2018). Its state is three optimizer variables
    (``optimizer.add_variable``), so checkpoints, the broadcast from rank 0 and elastic commits
    carry it with the optimizer's slots: a resumed run continues with the scale it had.

    Args:
        optimizer: the (Horovod-wrapped) Keras optimizer (Keras 2 or 3), already built.
        initial_scale: float, > 0.
        growth_interval: finite steps between doublings, >= 1.

    Raises:
        ValueError: for a non-positive scale or interval.
    """

    FACTOR = 2.0

    def __init__(self, optimizer, initial_scale: float = 2.0 ** 15, growth_interval: int = 2000):
        if not initial_scale > 0 or growth_interval < 1:
            raise ValueError(f"loss scale needs initial_scale > 0 and growth_interval >= 1, got {initial_scale}, "
                             f"{growth_interval}")
        self.growth_interval = int(growth_interval)
        constant = kerases.module(kerases.version_of(optimizer) or 2).initializers.Constant(initial_scale)
        self.scale = optimizer.add_variable(shape=(), dtype="float32", initializer=constant, name="loss_scale")
        self.finite_steps = optimizer.add_variable(shape=(), dtype="int64", initializer="zeros",
                                                   name="loss_scale_finite_steps")
        self.skipped_steps = optimizer.add_variable(shape=(), dtype="int64", initializer="zeros",
                                                    name="loss_scale_skipped_steps")

    def scale_loss(self, loss: tf.Tensor) -> tf.Tensor:
        """``loss · scale`` (float32 scalar in, float32 scalar out)."""
        return loss * self.scale

    def unscale(self, gradients: List[Optional[tf.Tensor]]) -> List[Optional[tf.Tensor]]:
        """Each float32 gradient divided by the scale (None stays None)."""
        inverse = 1.0 / self.scale
        return [None if g is None else g * tf.cast(inverse, g.dtype) for g in gradients]

    @staticmethod
    def all_finite(gradients: List[Optional[tf.Tensor]]) -> tf.Tensor:
        """bool scalar: no NaN or infinity in any gradient."""
        checks = [tf.reduce_all(tf.math.is_finite(g)) for g in gradients if g is not None]
        return tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)

    def update(self, finite: tf.Tensor) -> None:
        """After a step: halve the scale (and count a skipped step) if ``finite`` is False; double it
        after ``growth_interval`` finite steps in a row."""
        grow = tf.logical_and(finite, self.finite_steps + 1 >= self.growth_interval)
        self.scale.assign(tf.where(finite, tf.where(grow, self.scale * self.FACTOR, self.scale),
                                   tf.maximum(self.scale / self.FACTOR, 1e-30)))
        self.finite_steps.assign(tf.where(tf.logical_and(finite, tf.logical_not(grow)), self.finite_steps + 1,
                                          tf.zeros_like(self.finite_steps)))
        self.skipped_steps.assign_add(tf.where(finite, tf.constant(0, tf.int64), tf.constant(1, tf.int64)))


def not_float64(model) -> Optional[str]:
    """What keeps ``model`` (built under ``fp64``) from computing in float64, or None if nothing:
    the first layer, nested ones included, whose compute dtype or one of whose variables is of
    another dtype (a layer built with its own ``dtype=``, say), named with that dtype.

    Args:
        model: a built Keras model, Keras 2 or 3.
    """
    from hvdtrain.model.moving_statistics import sublayers

    # An input's declared dtype is not a computation: the next layer casts it to its own.
    layers = [layer for layer in [*sublayers(model), model] if type(layer).__name__ != "InputLayer"]
    for layer in layers:
        compute = getattr(layer, "compute_dtype", None)
        if compute is not None and tf.as_dtype(compute).is_floating and compute != "float64":
            return f"layer {layer.name!r} ({type(layer).__name__}) computes in {compute}"
    # Layers holding no others first: a model's weights are its layers'.
    for layer in sorted(layers, key=lambda layer: bool(sublayers(layer))):
        for variable in getattr(layer, "weights", []):
            dtype = tf.as_dtype(variable.dtype)
            if dtype.is_floating and dtype != tf.float64:
                return f"layer {layer.name!r} ({type(layer).__name__}) holds {variable.name} in {dtype.name}"
    return None
