"""Synchronized batch normalization over all Horovod ranks, exact for any per-rank batch sizes
(or, with ``synchronized=False``, per-rank batch normalization on the same kernels).

One layer in one module: its forward pass, allreduce and custom gradient change
together. :func:`layer_class` makes it a layer of Keras 2 or 3; the CPU kernels are
:mod:`hvdtrain.model.sync_bn_kernels`; how it computes is ``docs/sync_bn.md``.
"""
from __future__ import annotations

from types import ModuleType
from typing import Optional, Sequence, Union

import tensorflow as tf

from hvdtrain import kerases
from hvdtrain.model import sync_bn_kernels as kernels
from hvdtrain.model import sync_bn_statistics as statistics

ACTIVATIONS = (None, "relu")  # what SyncBatchNormalization can fuse after the normalization


def _world_size() -> int:
    import horovod.tensorflow as hvd

    return hvd.size() if hvd.is_initialized() else 1


def _allreduce_sum(tensor: tf.Tensor) -> tf.Tensor:
    import horovod.tensorflow as hvd

    # A group of one: fused with no other tensor, so reduced in the same order every step.
    return hvd.grouped_allreduce([tensor], op=hvd.Sum)[0]


class SyncBatchNormalizationBase:
    """Batch normalization whose batch statistics span the global batch of all Horovod ranks.

    In training, the mean and variance are those of the concatenation of every rank's batch, so
    N ranks with local batches ``B_1 ... B_N`` normalize (and back-propagate) exactly as one process
    with batch ``B_1 + ... + B_N``. Local batch sizes may differ and may be zero. Each training call
    at world size > 1 costs one allreduce forward and one backward, each of ``2·C + 1`` resp.
    ``2·C`` numbers. (With ``synchronized=False`` each rank uses its own batch's statistics and
    makes no collective call; see below.)

    How the statistics and their gradient are computed exactly (shifted float64 sums, one
    allreduce forward and one backward), the kernels each case runs on, the deliberate
    differences from Keras' layer and the caveats (every rank must call the layer alike) are in
    ``docs/sync_bn.md``.

    Args:
        axis: int or list of ints, the channel axis or axes (default -1, channels-last; use 1 for
            channels-first). Statistics are per entry of these axes, over all other axes.
        momentum: float in [0, 1], moving-average decay: ``moving = momentum·moving +
            (1 - momentum)·batch``.
        epsilon: float > 0 added to the variance before the square root.
        center: if True, add the learned offset ``beta``.
        scale: if True, multiply by the learned ``gamma``.
        beta_initializer, gamma_initializer, moving_mean_initializer, moving_variance_initializer:
            Keras initializers for the four per-channel weights.
        beta_regularizer, gamma_regularizer: optional Keras regularizers.
        beta_constraint, gamma_constraint: optional Keras constraints.
        unbiased_moving_variance: if True, the moving variance tracks the unbiased global batch
            variance ``var · N/(N - 1)``, as PyTorch's BatchNorm and Keras' fused kernel do (Keras'
            default for 4-D inputs); default False tracks the biased variance used for
            normalization, as Keras' layer does otherwise (``fused=False``, inputs of other ranks)
            and Horovod's ``SyncBatchNormalization``. Over N examples they differ by N/(N - 1).
        activation: None, or ``"relu"`` to return ``max(0, normalized)``: the same as a
            Keras ``ReLU`` layer after this one, fused into the normalization (as TensorFlow
            fuses its own batch norm with a following ReLU), so that on the CPU kernels the ReLU
            costs no memory pass of its own, forward or backward.
        synchronized: if True (default), batch statistics span all ranks' batches; if False, each
            rank's own batch (per-rank batch normalization, no collective call; the moving statistics
            then differ between ranks, and :func:`hvdtrain.model.moving_statistics.per_rank_moving_statistics` finds
            them). The name and meaning of Keras' ``BatchNormalization(synchronized=...)``.
        fused: accepted for Keras' configs (``None``, True or False); the kernels are chosen as
            ``docs/sync_bn.md`` says ("Which kernels run") and results do not depend on them. The
            attribute ``fused`` reads, once built, what Keras 2's layer of the same arguments
            reports (code written for Keras 2 reads it): False for a synchronized layer (as Keras'
            ``synchronized=True``); otherwise True for 4-D and 5-D inputs with channels first or
            last, not float64, unless ``fused=False``.
        renorm, renorm_clipping, renorm_momentum, virtual_batch_size, adjustment: Keras'
            arguments, accepted at their neutral values (``False``, any, any, ``None``, ``None``);
            batch renormalization and adjustment are not implemented (ValueError). Virtual
            ("ghost") batches are groups of a rank's own examples, which need no synchronization:
            the ValueError says to keep Keras' layer, which ``convert_sync_batchnorm`` leaves as it is.
        **kwargs: standard Keras layer arguments (``name``, ``dtype``, ``trainable``...).

    Call arguments:
        inputs: tensor of rank >= 2: float16, bfloat16, float32 or float64.
        training: Python bool or boolean scalar tensor. True normalizes with global batch statistics
            (this rank's, with ``synchronized=False``) and updates the moving statistics; False (or
            None) uses the moving statistics. A layer with ``trainable=False`` always runs in
            inference mode (Keras' fine-tuning convention).
        mask: None, or a boolean mask of the input's shape without its channel axis (``(batch,
            steps)`` for ``(batch, steps, C)``), as Keras hands on from ``Embedding(mask_zero=True)``:
            masked positions are left out of the global sums and counts of the batch statistics,
            as Keras' layer leaves them out of its batch's (:mod:`hvdtrain.model.sync_bn_statistics`);
            every position is normalized.

    Input shape:
        Arbitrary, rank >= 2, with the ``axis`` dimensions known, e.g. ``(batch, C)``,
        ``(batch, steps, C)``, ``(batch, H, W, C)`` or ``(batch, C, H, W)`` with ``axis=1``.

    Output shape:
        Same shape as the input. Same dtype as a floating input; under a mixed policy
        (``mixed_float16``/``mixed_bfloat16``) the compute dtype, as Keras' layer (its statistics
        and weights stay float32); for an integer input the compute dtype (normalized, not truncated).

    Reference:
        Ioffe & Szegedy, "Batch Normalization: Accelerating Deep Network Training by Reducing
        Internal Covariate Shift", ICML 2015. Peng et al., "MegDet: A Large Mini-Batch Object
        Detector", CVPR 2018 (cross-GPU batch normalization). Chan, Golub & LeVeque, "Algorithms for
        Computing the Sample Variance: Analysis and Recommendations", The American Statistician 1983.

    Raises:
        ValueError: in the constructor for ``momentum`` outside [0, 1], ``epsilon <= 0``, a
            non-integer ``axis`` or an ``activation`` other than None and ``"relu"``; when built
            for an input whose rank is < 2, whose ``axis`` is out of range or repeated, or whose
            channel dimensions are unknown; when called with a mask of another shape (or on a
            layer of several channel axes); for ``renorm``, ``adjustment`` or ``virtual_batch_size``.

    """

    def __init__(self, axis: Union[int, Sequence[int]] = -1, momentum: float = 0.99, epsilon: float = 1e-3,
                 center: bool = True, scale: bool = True, beta_initializer="zeros", gamma_initializer="ones",
                 moving_mean_initializer="zeros", moving_variance_initializer="ones", beta_regularizer=None,
                 gamma_regularizer=None, beta_constraint=None, gamma_constraint=None,
                 unbiased_moving_variance: bool = False, activation: Optional[str] = None, synchronized: bool = True,
                 fused: Optional[bool] = None, renorm: bool = False, renorm_clipping: Optional[dict] = None,
                 renorm_momentum: float = 0.99, virtual_batch_size: Optional[int] = None, adjustment=None,
                 **kwargs):
        # Keras' cast of floating inputs to the compute dtype happens in call, under a mixed policy
        # only: with the float32 policy, half-precision inputs keep their dtype.
        kwargs.setdefault("autocast", False)
        super().__init__(**kwargs)
        # Keras' arguments, so that the layer takes any BatchNormalization's config: `fused` picks
        # Keras' kernel and changes no result; the others change the algorithm, which this layer
        # does not implement (renorm_clipping and renorm_momentum mean nothing without renorm).
        if fused not in (None, True, False):
            raise ValueError(f"fused must be None, True or False, got {fused!r}")
        for argument, value, neutral in (("renorm", renorm, False), ("adjustment", adjustment, None)):
            if value is not neutral and value != neutral:
                raise ValueError(f"SyncBatchNormalization does not implement {argument} (got {argument}={value!r}): "
                                 f"use Keras' BatchNormalization, which normalizes each rank's batch alone")
        if virtual_batch_size is not None:
            raise ValueError(f"SyncBatchNormalization takes no virtual_batch_size (got {virtual_batch_size!r}): "
                             f"virtual batches are groups of a rank's own examples, which need no synchronization. "
                             f"Keep Keras' BatchNormalization(virtual_batch_size=...) (convert_sync_batchnorm leaves "
                             f"it as it is): where it divides the local batch, each rank's virtual batches are those "
                             f"of one process on the global batch")
        axes = list(axis) if isinstance(axis, (list, tuple)) else [axis]
        if not axes or not all(isinstance(a, int) and not isinstance(a, bool) for a in axes):
            raise ValueError(f"axis must be an int or a non-empty list of ints, got {axis!r}")
        if not 0.0 <= float(momentum) <= 1.0:
            raise ValueError(f"momentum must be in [0, 1], got {momentum!r}")
        if not float(epsilon) > 0.0:
            raise ValueError(f"epsilon must be > 0, got {epsilon!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.axis = axes if isinstance(axis, (list, tuple)) else axis
        self.momentum = float(momentum)
        self.epsilon = float(epsilon)
        self.center = bool(center)
        self.scale = bool(scale)
        self.beta_initializer = self._keras.initializers.get(beta_initializer)
        self.gamma_initializer = self._keras.initializers.get(gamma_initializer)
        self.moving_mean_initializer = self._keras.initializers.get(moving_mean_initializer)
        self.moving_variance_initializer = self._keras.initializers.get(moving_variance_initializer)
        self.beta_regularizer = self._keras.regularizers.get(beta_regularizer)
        self.gamma_regularizer = self._keras.regularizers.get(gamma_regularizer)
        self.beta_constraint = self._keras.constraints.get(beta_constraint)
        self.gamma_constraint = self._keras.constraints.get(gamma_constraint)
        self.unbiased_moving_variance = bool(unbiased_moving_variance)
        self.activation = activation
        self.synchronized = bool(synchronized)
        self.fused = False if self.synchronized else fused  # resolved in build, as Keras 2's
        self.supports_masking = True

    def build(self, input_shape):
        input_shape = tf.TensorShape(input_shape)
        ndim = input_shape.rank
        if ndim is None or ndim < 2:
            raise ValueError(f"{self.name}: input must have rank >= 2, got shape {input_shape}")
        axes = self.axis if isinstance(self.axis, list) else [self.axis]
        if any(not -ndim <= a < ndim for a in axes):
            raise ValueError(f"{self.name}: axis {self.axis} out of range for input shape {input_shape}")
        self._axes = sorted(a % ndim for a in axes)
        if len(set(self._axes)) != len(self._axes):
            raise ValueError(f"{self.name}: axis {self.axis} repeats an axis of input shape {input_shape}")
        if 0 in self._axes:
            raise ValueError(f"{self.name}: axis {self.axis} includes the batch axis 0")
        param_shape = [input_shape[a] for a in self._axes]
        if any(d is None for d in param_shape):
            raise ValueError(f"{self.name}: channel dimension(s) {self.axis} of {input_shape} must be known")
        self._reduction_axes = [a for a in range(ndim) if a not in self._axes]
        self._broadcast_shape = [input_shape[a] if a in self._axes else 1 for a in range(ndim)]
        self._channels = 1
        for d in param_shape:
            self._channels *= d
        self.input_spec = self._keras.layers.InputSpec(ndim=ndim, axes={a: input_shape[a] for a in self._axes})
        if self.fused is not False:  # Keras 2's reading: whether its fused kernel runs
            self.fused = (ndim, self._axes) in ((4, [1]), (4, [3]), (5, [1]), (5, [4])) and self.dtype != "float64"

        param_dtype = tf.float32 if self.dtype in ("float16", "bfloat16") else self.dtype
        # Weights stay float32 under a mixed policy; Keras 2's statistics aggregate as its own layer's.
        keras3 = kerases.version_of(self._keras.layers.Layer) == 3
        float32 = {"autocast": False} if keras3 else {"experimental_autocast": False}
        statistic = {} if keras3 else {"synchronization": tf.VariableSynchronization.ON_READ,
                                       "aggregation": tf.VariableAggregation.MEAN}
        if self.scale:
            self.gamma = self.add_weight(
                name="gamma", shape=param_shape, dtype=param_dtype, initializer=self.gamma_initializer,
                regularizer=self.gamma_regularizer, constraint=self.gamma_constraint, **float32,
            )
        else:
            self.gamma = None
        if self.center:
            self.beta = self.add_weight(
                name="beta", shape=param_shape, dtype=param_dtype, initializer=self.beta_initializer,
                regularizer=self.beta_regularizer, constraint=self.beta_constraint, **float32,
            )
        else:
            self.beta = None
        stat = dict(shape=param_shape, dtype=param_dtype, trainable=False, **float32,
                    **statistic)
        self.moving_mean = self.add_weight(name="moving_mean", initializer=self.moving_mean_initializer, **stat)
        self.moving_variance = self.add_weight(
            name="moving_variance", initializer=self.moving_variance_initializer, **stat)
        super().build(input_shape)

    # Per-channel quantities are flat [C] vectors; element-wise work runs on the CPU kernels or on
    # TensorFlow ops (docs/sync_bn.md, "Which kernels run").
    def _compute_dtype_of(self, inputs) -> tf.DType:
        """float64 for float64 inputs (or integer inputs to a float64 layer), float32 for any other
        (half precision included)."""
        float64 = inputs.dtype == tf.float64 or (not inputs.dtype.is_floating and self.compute_dtype == "float64")
        return tf.float64 if float64 else tf.float32

    def _output_dtype_of(self, inputs) -> tf.DType:
        """The input's dtype (after Keras' cast of floating inputs to the compute dtype), or for
        integer inputs the compute dtype, as Keras' layer."""
        return inputs.dtype if inputs.dtype.is_floating else tf.as_dtype(self.compute_dtype)

    def _flat_params(self, dtype: tf.DType):
        """gamma, beta as ``[C]`` vectors of ``dtype`` (ones/zeros when disabled)."""
        c = self._channels
        gamma = tf.ones([c], dtype) if self.gamma is None else tf.reshape(tf.cast(self.gamma, dtype), [c])
        beta = tf.zeros([c], dtype) if self.beta is None else tf.reshape(tf.cast(self.beta, dtype), [c])
        return gamma, beta

    def _per_element(self, v):
        """Reshape a ``[C]`` vector to broadcast against the input (TensorFlow path)."""
        return tf.reshape(v, self._broadcast_shape)

    def _channel_sums(self, t):
        """Per-channel sums of ``t`` as a flat ``[C]`` vector (TensorFlow path)."""
        return statistics.channel_sums(t, self._reduction_axes, self._channels)

    def _use_kernels(self, dtype: tf.DType, weights=None) -> bool:
        """The CPU kernels take float32, channels-last inputs, without a mask."""
        return (dtype == tf.float32 and weights is None and self._axes == [len(self._broadcast_shape) - 1]
                and kernels.available())

    def call(self, inputs, training=None, mask=None):
        if training is None or not self.trainable:
            training = False
        if inputs.dtype.is_floating and self.compute_dtype != self.variable_dtype:  # mixed_float16/bfloat16
            inputs = tf.cast(inputs, self.compute_dtype)  # as Keras: outputs in the compute dtype
        # Keras hands on the previous layer's mask (Embedding(mask_zero=True)): the statistics leave it out.
        weights = None if mask is None else statistics.mask_weights(
            mask, inputs.shape, self._axes, self._compute_dtype_of(inputs), self.name)
        return tf.__internal__.smart_cond.smart_cond(
            training, lambda: self._training_call(inputs, weights), lambda: self._inference_call(inputs))

    def _inference_call(self, inputs):
        dtype = self._compute_dtype_of(inputs)
        gamma, beta = self._flat_params(dtype)
        mean = tf.reshape(tf.cast(self.moving_mean, dtype), [self._channels])
        variance = tf.reshape(tf.cast(self.moving_variance, dtype), [self._channels])
        scale = gamma * tf.math.rsqrt(variance + self.epsilon)
        x = tf.cast(inputs, dtype)
        if self._use_kernels(dtype):
            y = kernels.normalize(x, mean, scale, beta, relu=self._relu)
        else:
            y = self._activate((x - self._per_element(mean)) * self._per_element(scale) + self._per_element(beta))
        return tf.cast(y, self._output_dtype_of(inputs))

    @property
    def _relu(self) -> bool:
        return self.activation == "relu"

    def _activate(self, z):
        """The fused activation on the TensorFlow path."""
        return tf.nn.relu(z) if self._relu else z

    def _local_shifted_sums(self, x, shift, count, weights=None):
        """This rank's per-channel ``Σ(x - shift)`` and ``Σ(x - shift)²`` over the positions the
        mask's ``weights`` keep (all without), float64 ``[C]`` each; ``count`` is their number
        (float64 scalar). Kernel path: one pass, float64 accumulation; TensorFlow path:
        :func:`hvdtrain.model.sync_bn_statistics.local_shifted_sums`."""
        if self._use_kernels(x.dtype, weights):
            return kernels.moments(x, shift)
        return statistics.local_shifted_sums(x, shift, count, self._reduction_axes, self._broadcast_shape, weights)

    def _local_count(self, x, weights=None) -> tf.Tensor:
        """This rank's positions per channel in ``x`` that the mask keeps (float64 scalar)."""
        return statistics.local_count(x, self._channels, weights)

    @property
    def _collective(self) -> bool:
        """Whether training calls allreduce: synchronized, with more than one rank."""
        return self.synchronized and _world_size() > 1

    def _global_moments(self, x, shift, weights=None):
        """Global count, mean and biased variance over all ranks' batches: one float64 allreduce
        (or over this rank's batch, with no collective call, unless :attr:`_collective`).

        Args:
            x: local input in the compute dtype (float32 or float64).
            shift: float64 ``[C]``, identical on every rank.
            weights: the mask's 0/1 weights (broadcasting against ``x``), or None.

        Returns:
            ``(count, mean, variance)``: a float64 scalar and two float64 ``[C]`` vectors; mean and
            variance are 0 when the global count is 0.
        """
        local_count = self._local_count(x, weights)
        shifted_sum, shifted_sq_sum = self._local_shifted_sums(x, shift, local_count, weights)
        packed = tf.concat([[local_count], shifted_sum, shifted_sq_sum], 0)
        if self._collective:
            packed = _allreduce_sum(packed)  # the layer's one forward collective
        count = packed[0]
        shifted_sum, shifted_sq_sum = tf.split(packed[1:], 2)
        mean_offset = tf.math.divide_no_nan(shifted_sum, count)
        variance = tf.maximum(tf.math.divide_no_nan(shifted_sq_sum, count) - tf.square(mean_offset), 0.0)
        return count, shift + mean_offset, variance

    def _use_fused_op(self, inputs) -> bool:
        """Off the CPU kernels, a rank that normalizes its own batch alone (no collective call) uses
        TensorFlow's fused batch norm, as Keras' layer does (cuDNN's kernels on a GPU): float32,
        float16 or bfloat16 NHWC or NCHW inputs, and an epsilon the op accepts (>= 1.001e-5)."""
        return (not self._collective and inputs.dtype in (tf.float32, tf.float16, tf.bfloat16)
                and inputs.shape.rank == 4 and self._axes in ([1], [3]) and self.epsilon >= 1.001e-5)

    def _fused_training_call(self, x):
        """Training on this rank's batch through ``tf.compat.v1.nn.fused_batch_norm``: its output,
        statistics and gradient (``FusedBatchNormGradV3``), then the ReLU and the moving statistics.
        Half-precision ``x`` goes in as it is (float32 statistics, output in ``x``'s dtype), as in
        Keras' layer."""
        gamma, beta = self._flat_params(tf.float32)
        y, mean, variance = tf.compat.v1.nn.fused_batch_norm(
            x, gamma, beta, epsilon=self.epsilon, data_format="NHWC" if self._axes == [3] else "NCHW",
            is_training=True)
        # The op returns the batch variance with Bessel's correction, var·n/(n - 1); undo it (the
        # variance of one example is 0; with none, the moving statistics are not updated).
        count = self._local_count(x)
        variance = tf.where(count > 1.0, tf.cast(variance, tf.float64) * (count - 1.0) / tf.maximum(count, 1.0), 0.0)
        statistics.update_moving_statistics(self, count, tf.cast(mean, tf.float64), variance)
        return self._activate(y)

    def _training_call(self, inputs, weights=None):
        dtype = self._compute_dtype_of(inputs)
        use_kernels = self._use_kernels(dtype, weights)
        if not use_kernels and weights is None and self._use_fused_op(inputs):
            return self._fused_training_call(inputs)
        x = tf.cast(inputs, dtype)
        shift = tf.stop_gradient(tf.reshape(tf.cast(self.moving_mean, tf.float64), [self._channels]))
        count, mean, variance = self._global_moments(x, shift, weights)
        statistics.update_moving_statistics(self, count, mean, variance)

        # Float32 hi + lo split of the float64 mean: x - hi is exact when x is near the mean
        # (Sterbenz), so the normalized value keeps float32 precision even when |mean| >> std.
        # (In float64, hi is the mean and lo is 0.)
        mean_hi = tf.cast(mean, dtype)
        mean_lo = tf.cast(mean - tf.cast(mean_hi, tf.float64), dtype)
        inv_std64 = tf.math.rsqrt(variance + self.epsilon)
        inv_std = tf.cast(inv_std64, dtype)
        n_inv = tf.math.divide_no_nan(tf.constant(1.0, tf.float64), count)
        gamma, beta = self._flat_params(dtype)
        per_element = self._per_element
        relu = self._relu

        @tf.custom_gradient
        def normalize(x, gamma, beta):
            scale = gamma * inv_std
            offset = beta - mean_lo * scale
            if use_kernels:
                y = kernels.normalize(x, mean_hi, scale, offset, relu=relu)
            else:
                y = self._activate((x - per_element(mean_hi)) * per_element(scale) + per_element(offset))

            def grad(dy):
                dy = tf.cast(dy, dtype)
                # With the fused ReLU, the gradient below is that of the normalization with dy
                # masked where y = 0 (the kernels recompute the mask from x; see their source).
                if relu and not use_kernels:
                    dy = dy * tf.cast(y > 0.0, dtype)  # as TensorFlow's ReluGrad
                # Local Σdy and Σdy·(x - hi), then Σdy·x̂ = (Σdy·(x - hi) - lo·Σdy)·inv_std.
                if use_kernels:
                    sum_dy, sum_dy_centered = kernels.grad_sums(dy, x, mean_hi, scale, offset, relu=relu)
                else:
                    sum_dy = tf.cast(self._channel_sums(dy), tf.float64)
                    sum_dy_centered = tf.cast(self._channel_sums(dy * (x - per_element(mean_hi))), tf.float64)
                sum_dy_xhat = (sum_dy_centered - tf.cast(mean_lo, tf.float64) * sum_dy) * inv_std64
                local = tf.concat([sum_dy, sum_dy_xhat], 0)
                total = _allreduce_sum(local) if self._collective else local  # the one backward collective
                total_dy, total_dy_xhat = tf.split(total, 2)
                # dx = scale·(dy - w·Σdy/N - w·x̂·Σdy·x̂/N), folded into scale·dy + w·(b·(x - hi) + c):
                # the statistics depend on the positions the mask keeps (w = 1) alone.
                scale64 = tf.cast(scale, tf.float64)
                b64 = -scale64 * inv_std64 * total_dy_xhat * n_inv
                c64 = -scale64 * total_dy * n_inv - b64 * tf.cast(mean_lo, tf.float64)
                b, c = tf.cast(b64, dtype), tf.cast(c64, dtype)
                if use_kernels:
                    dx = kernels.grad_input(dy, x, mean_hi, scale, offset, b, c, relu=relu)
                else:
                    through_statistics = per_element(b) * (x - per_element(mean_hi)) + per_element(c)
                    dx = per_element(scale) * dy + (through_statistics if weights is None else
                                                    weights * through_statistics)
                return dx, tf.cast(sum_dy_xhat, dtype), tf.cast(sum_dy, dtype)

            return y, grad

        return tf.cast(normalize(x, gamma, beta), self._output_dtype_of(inputs))

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        k = self._keras
        config = {name: getattr(self, name) for name in (
            "axis", "momentum", "epsilon", "center", "scale", "unbiased_moving_variance", "activation", "synchronized")}
        for kind, serialize in (("initializer", k.initializers.serialize), ("regularizer", k.regularizers.serialize),
                                ("constraint", k.constraints.serialize)):
            for weight in ("beta", "gamma") + (("moving_mean", "moving_variance") if kind == "initializer" else ()):
                config[f"{weight}_{kind}"] = serialize(getattr(self, f"{weight}_{kind}"))
        return {**super().get_config(), **config}


def layer_class(keras: ModuleType) -> type:
    """:class:`SyncBatchNormalizationBase` as a layer of ``keras`` (a Keras 2 or Keras 3 package;
    :mod:`hvdtrain.kerases`), registered for deserialization as ``hvdtrain>SyncBatchNormalization``
    (:func:`hvdtrain.kerases.class_for`)."""
    return kerases.class_for(SyncBatchNormalizationBase, keras, "layers.Layer")


def __getattr__(name):
    if name == "SyncBatchNormalization":  # TensorFlow's default Keras's, as hvdtrain.SyncBatchNormalization
        return layer_class(kerases.module(kerases.default_version()))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
