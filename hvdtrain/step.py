"""The compiled training step of one rank: forward and backward pass, gradient allreduce, update.

Three shapes of one step, picked by :func:`make_train_step`:

* float32 and bf16 (the default): the backward pass, Horovod's allreduce of the gradients and the
  update, in one ``tf.function`` (Keras 2: the wrapped ``compute_gradients``, then
  ``apply_gradients``; Keras 3: the wrapped ``_allreduce``, then ``_apply_allreduced``);
* ``--xla``: the forward and backward pass is compiled by XLA (``jit_compile``); Horovod's
  allreduce, which is no XLA op, and the update run after it, outside;
* ``--precision fp16``: the loss is scaled before the backward pass and the gradients unscaled
  before the allreduce; a step whose allreduced gradients are not finite is skipped on every rank
  alike (:mod:`hvdtrain.precision`), and what its forward pass wrote is restored.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Tuple

import tensorflow as tf

from hvdtrain.kerases import is_floating
from hvdtrain.model.fused_bn import fuse_keras3_batch_norm
from hvdtrain.task import Objective
from hvdtrain.precision import DynamicLossScale


def to_model_input(images: tf.Tensor) -> tf.Tensor:
    """uint8 pixels ``(b, H, W, C)`` -> float32 in [0, 1]; float data passes through as float32."""
    if images.dtype == tf.uint8:
        return tf.cast(images, tf.float32) * (1.0 / 255.0)
    return tf.cast(images, tf.float32)


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """What a training step is called with, and how it makes the local batch of it.

    Attributes:
        signature: the ``tf.TensorSpec`` of each argument before ``global_count``.
        batch: the arguments -> ``(images, labels)``: float32 ``(b, H, W, C)``, and the labels
            ``(b, ...)`` as stored, int32 classes or float32 targets (called inside the compiled step).
    """

    signature: List[tf.TensorSpec]
    batch: Callable


def gathered(x_train: tf.Tensor, y_train: tf.Tensor) -> StepInputs:
    """Steps called with int32 ``(b,)`` indices into the training set held on the device,
    ``(n, H, W, C)`` images and ``(n, ...)`` labels: only the indices cross to the device each step."""
    return StepInputs([tf.TensorSpec([None], tf.int32)],
                      lambda indices: (to_model_input(tf.gather(x_train, indices)), tf.gather(y_train, indices)))


def streamed(image_shape, image_dtype: tf.DType, label_shape=(), label_dtype: tf.DType = tf.int32) -> StepInputs:
    """Steps called with a batch from tf.data: images ``(b, *image_shape)`` of ``image_dtype`` and
    labels ``(b, *label_shape)`` of ``label_dtype``."""
    return StepInputs([tf.TensorSpec([None, *image_shape], image_dtype), tf.TensorSpec([None, *label_shape], label_dtype)],
                      lambda images, labels: (to_model_input(images), labels))


def _as_is(method: Callable) -> Callable:
    """``method`` traced as it is, not converted by AutoGraph: Horovod's and Keras' optimizer code has
    no Python control flow on tensors, and converting it takes about a second of every rank's start."""
    return tf.autograph.experimental.do_not_convert(method)


def _allreduce(optimizer) -> Callable:
    """``(gradients, variables) -> gradients`` averaged over ranks by the Horovod-wrapped
    ``optimizer`` (Keras 2 or 3); the gradients as they are for a plain optimizer (one process)."""
    if not hasattr(optimizer, "_allreduce"):
        return lambda gradients, variables: gradients
    return _as_is(optimizer._allreduce)  # pylint: disable=protected-access


def _apply(optimizer) -> Callable:
    """``(gradients, variables) -> None``: the update with allreduced gradients. Keras 3's wrapped
    ``apply`` would allreduce again (scripts/horovod-patches/0006-keras3-distributed-optimizer.patch):
    its second half, ``_apply_allreduced``, updates alone."""
    if hasattr(optimizer, "_apply_allreduced"):
        return _as_is(optimizer._apply_allreduced)  # pylint: disable=protected-access
    if hasattr(optimizer, "stateless_apply"):  # a plain Keras 3 optimizer
        return _as_is(optimizer.apply)
    return lambda gradients, variables: _as_is(optimizer.apply_gradients)(zip(gradients, variables))


def make_train_step(model, optimizer, world_size: int, inputs: StepInputs,
                    objective: Objective, sums: tf.Variable, loss_scale: Optional[DynamicLossScale] = None,
                    xla: bool = False) -> Tuple[Callable, Optional[Callable]]:
    """Build this rank's compiled training step.

    Args:
        model: the Keras model, Keras 2 or 3 (float32 or, under ``fp64``, float64 variables; any compute dtype).
        optimizer: ``hvd.DistributedOptimizer``-wrapped Keras optimizer of the model's Keras (a
            plain one trains without collectives).
        world_size: number of ranks: the local loss sum is scaled by ``world_size / global_count``.
        inputs: what the step is called with (:func:`gathered`, :func:`streamed`).
        objective: the loss and metrics.
        sums: float64 ``(objective.size,)`` variable that accumulates the objective's sums of
            trained examples.
        loss_scale: fp16's dynamic loss scale, or None.
        xla: compile the forward and backward pass with XLA.

    Returns:
        ``(train_step, local_gradients)``: ``train_step(*inputs, global_count)`` (the local batch
        as ``inputs`` takes it, float32 scalar examples in the global batch) runs one step;
        ``local_gradients(images, labels, global_count)`` is the forward and backward pass of the
        split shapes (for inspection of XLA's IR), None on the default path.
    """
    fuse_keras3_batch_norm(model)  # Keras 3's BatchNormalization through TensorFlow's fused kernel
    variables = model.trainable_variables

    def scaled_loss(images, labels, global_count):
        """The loss whose gradient, averaged over ranks, is the global batch's mean loss gradient."""
        per_example, batch_sums = objective(labels, model(images, training=True))
        # Sum over the local batch scaled by world_size / global_count: Horovod averages the ranks'
        # gradients, so the result is the gradient of the mean loss over the global batch, exact
        # even when local batches differ in size (the last step of an epoch).
        loss = tf.reduce_sum(per_example) * (world_size / tf.cast(global_count, per_example.dtype))
        if model.losses:  # a layer of another dtype (float32 in a float64 model) adds its own
            loss += tf.add_n([tf.cast(term, loss.dtype) for term in model.losses])
        return loss, batch_sums

    signature = [*inputs.signature, tf.TensorSpec([], tf.float32)]
    allreduce, apply = _allreduce(optimizer), _apply(optimizer)
    keras2 = not hasattr(optimizer, "stateless_apply")  # Keras 3's optimizers have it
    if loss_scale is None and not xla:
        @tf.function(input_signature=signature)
        def train_step(*args):
            *batch, global_count = args
            images, labels = inputs.batch(*batch)
            with tf.GradientTape() as tape:
                loss, batch_sums = scaled_loss(images, labels, global_count)
            # Horovod's ring-allreduce averages the gradients over ranks, before the update: in a
            # Keras 2 wrapper's compute_gradients (which a user's optimizer may override), in
            # Keras 3's _allreduce.
            if keras2:
                _as_is(optimizer.apply_gradients)(_as_is(optimizer.compute_gradients)(loss, variables, tape=tape))
            else:
                apply(allreduce(tape.gradient(loss, variables), variables), variables)
            sums.assign_add(batch_sums)

        return train_step, None

    # This rank's gradients, unscaled, and its metric sums; XLA compiles it under --xla.
    @tf.function(jit_compile=xla or None)
    def local_gradients(images, labels, global_count):
        with tf.GradientTape() as tape:
            loss, batch_sums = scaled_loss(images, labels, global_count)
            if loss_scale is not None:  # fp16: small gradients would flush to zero unscaled
                loss = loss_scale.scale_loss(loss)
        gradients = tape.gradient(loss, variables)
        if loss_scale is not None:  # unscaled before the allreduce, so that is in true units
            gradients = loss_scale.unscale(gradients)
        return gradients, batch_sums

    # What the forward pass itself writes (BatchNorm's moving statistics): a skipped fp16 step
    # restores it, or one overflowing batch would leave them NaN for good.
    forward_state = [v for v in model.non_trainable_variables if is_floating(v)] if loss_scale else []

    @tf.function(input_signature=signature)
    def train_step(*args):
        *batch, global_count = args
        images, labels = inputs.batch(*batch)
        saved = [tf.identity(v) for v in forward_state]  # read before the forward pass writes them
        gradients, batch_sums = local_gradients(images, labels, global_count)
        # Horovod's ring-allreduce, after the backward pass (outside XLA: no XLA op).
        gradients = allreduce(gradients, variables)
        if loss_scale is None:
            apply(gradients, variables)
            sums.assign_add(batch_sums)
            return
        # The allreduced gradients are alike on every rank, and non-finite on every rank if they
        # were on any (hvdtrain.precision): every rank skips or applies the same step.
        finite = loss_scale.all_finite(gradients)

        def update():
            apply(gradients, variables)
            sums.assign_add(batch_sums)  # a skipped step's examples are left out of the metrics
            return tf.constant(True)

        def skip():
            for variable, value in zip(forward_state, saved):
                variable.assign(value)
            return tf.constant(False)

        tf.cond(finite, update, skip)
        loss_scale.update(finite)

    return train_step, local_gradients
