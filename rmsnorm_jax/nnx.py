"""Flax NNX ``RMSNorm``: the twin of :class:`rmsnorm_jax.RMSNorm` for ``flax.nnx``.

Mirrors ``flax.nnx.RMSNorm`` (same arguments, a ``scale`` Param of shape
``(num_features,)``) and adds ``p``, ``use_bias``, ``scale_offset``, ``eps_placement``
and ``implementation``. It calls :func:`rmsnorm_jax.rms_norm`, so its outputs and
gradients equal the linen Module's on the same parameters.

:meth:`RMSNorm.gemma` is the one-line swap for models that define their own zero-centred
``(1 + scale)`` norm (Gemma's code; MaxText's norm is ``x_hat * scale``, see
``rmsnorm_jax.integrations.patch_maxtext``): it takes their argument names
(``weight_dtype``, ``scale_metadata``) and their semantics.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes
from flax.typing import Axes, Dtype, Initializer

from ._config import check_implementation
from ._module_utils import feature_param_shapes, normalize, unsupported_options


class RMSNorm(nnx.Module):
    r"""RMS layer normalisation (and pRMSNorm) as a Flax NNX Module.

    For each row (the elements over ``reduction_axes``)::

        y = (scale + scale_offset) * x / RMS(x) + bias,
        RMS(x) = sqrt(mean(x[:k]**2) + epsilon),  k = ceil(n * p)

    Dtypes: statistics in at least float32; parameters stored in ``param_dtype``;
    output in ``dtype``, else the promotion of ``x`` and the parameters. Backward
    residuals: ``x``, ``scale`` and one float32 per row.

    Args:
      num_features: number of features (the product of ``x.shape`` over
        ``feature_axes``).
      epsilon, dtype, param_dtype, use_scale, scale_init, reduction_axes,
        feature_axes, axis_name, axis_index_groups, use_fast_variance: as in
        ``flax.nnx.RMSNorm`` (``axis_index_groups`` must be None;
        ``use_fast_variance`` has no effect on an RMS).
      promote_dtype: ``fn((x, scale), dtype=...) -> (x, scale)`` applied before
        normalising (``(x, scale, bias)`` with ``use_bias``). The default is flax's
        ``promote_dtype``, as in ``flax.nnx.RMSNorm``: with ``dtype`` set, ``x`` and
        the parameters are cast to it first. None: no cast (then the Module computes
        exactly as the linen one).
      rngs: ``nnx.Rngs`` for the initializers.
      scale_metadata, bias_metadata: metadata of the Params, e.g.
        ``{"out_sharding": ("embed",)}``.
      p: fraction in (0, 1] of each row's features the RMS is estimated from.
      use_bias, bias_init: an optional learned shift (default off, zeros).
      scale_offset: added to ``scale``; 1.0 with ``scale_init=zeros`` is Gemma's.
      eps_placement: ``"inside"`` or ``"outside"``.
      activation, norm_before_gate, group_size: the gated form, used when called
        with ``gate=`` (see :func:`rmsnorm_jax.gated_rms_norm`).
      implementation: which path computes the norm: ``"xla"``, ``"pallas"`` (the
        fused kernels) or ``"auto"`` (per backend and shape, from measurements; XLA
        where none).

    A scale initialised to exactly zero with ``scale_offset=0`` makes the layer output
    zero for every input: that is a Gemma-style ``(1 + scale)`` parameter read as
    ``x_hat * scale``, so a ``UserWarning`` names the fix (:meth:`gemma`, or
    ``scale_offset=1.0``). Checked only where the initial value is concrete (not under
    ``jit`` or ``nnx.eval_shape``); parameters loaded later are not checked.

    Example:

    >>> import jax
    >>> from flax import nnx
    >>> import rmsnorm_jax.nnx
    >>> layer = rmsnorm_jax.nnx.RMSNorm(6, p=0.5, rngs=nnx.Rngs(0))
    >>> layer(jax.random.normal(jax.random.key(0), (5, 6))).shape
    (5, 6)
    """

    def __init__(
        self,
        num_features: int,
        *,
        epsilon: float = 1e-6,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        use_scale: bool = True,
        scale_init: Initializer = nnx.initializers.ones,
        reduction_axes: Axes = -1,
        feature_axes: Axes = -1,
        axis_name: str | None = None,
        axis_index_groups: Any = None,
        use_fast_variance: bool = True,
        promote_dtype: Callable[..., Any] | None = dtypes.promote_dtype,
        rngs: nnx.Rngs,
        scale_metadata: Mapping[str, Any] = MappingProxyType({}),
        p: float = 1.0,
        use_bias: bool = False,
        bias_init: Initializer = nnx.initializers.zeros,
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
        scale_offset: float = 0.0,
        eps_placement: str = "inside",
        activation: str = "silu",
        norm_before_gate: bool = True,
        group_size: int | None = None,
        implementation: str = "auto",
    ):
        unsupported_options(axis_index_groups)
        check_implementation(implementation)
        shape = (num_features,)
        self.scale = (
            nnx.Param(scale_init(rngs.params(), shape, param_dtype), **scale_metadata)
            if use_scale
            else nnx.data(None)
        )
        self.bias = (
            nnx.Param(bias_init(rngs.params(), shape, param_dtype), **bias_metadata)
            if use_bias
            else nnx.data(None)
        )
        self.num_features = num_features
        self.epsilon = epsilon
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.use_scale = use_scale
        self.use_bias = use_bias
        self.reduction_axes = reduction_axes
        self.feature_axes = feature_axes
        self.axis_name = axis_name
        self.axis_index_groups = axis_index_groups
        self.use_fast_variance = use_fast_variance
        self.promote_dtype = promote_dtype
        self.p = p
        self.scale_offset = scale_offset
        self.eps_placement = eps_placement
        self.activation = activation
        self.norm_before_gate = norm_before_gate
        self.group_size = group_size
        self.implementation = implementation

    @classmethod
    def gemma(
        cls,
        num_features: int,
        *,
        epsilon: float = 1e-6,
        dtype: Dtype | None = None,
        weight_dtype: Dtype | None = None,
        param_dtype: Dtype | None = None,
        scale_init: Initializer = nnx.initializers.zeros,
        scale_metadata: Mapping[str, Any] = MappingProxyType({}),
        rngs: nnx.Rngs,
        **kwargs: Any,
    ) -> RMSNorm:
        r"""Gemma's zero-centred RMSNorm, ``x_hat * (1 + scale)``, in one line.

        ``y = x / sqrt(mean(x**2) + epsilon) * (1 + scale)`` over the last axis, with
        ``scale`` initialised to zeros, so the stored parameter is the one such models
        (Google's Gemma code, and their checkpoints) store: load it as it is.

        Not for MaxText: MaxText's ``RMSNorm`` computes ``x_hat * scale`` (its Gemma
        converters fold the ``+1`` into the stored scale; only Qwen3-Next uses
        ``scale_offset=1``), so this would add a second ``+1`` to its parameters. Use
        :func:`rmsnorm_jax.integrations.patch_maxtext`, which keeps MaxText's own
        Module and parameters. The statistic, the
        normalisation and ``1 + scale`` are computed in float32 (at least), then cast
        to ``dtype``; ``x`` and ``scale`` are not cast to ``dtype`` first (no
        ``promote_dtype``), so ``1 + scale`` keeps the weight's precision. Output
        dtype: ``dtype``, else the promotion of ``x`` and the weight (float32 for
        bfloat16 ``x`` and float32 weights: give ``dtype=jnp.bfloat16`` to keep
        bfloat16 activations).

        Args:
          num_features: size of the last axis (Gemma's ``dim``).
          epsilon: added to the mean square (Gemma and MaxText: 1e-6).
          dtype: output dtype (MaxText's ``dtype``).
          weight_dtype: storage dtype of ``scale`` (MaxText's name; default float32).
          param_dtype: flax's name for the same; give one of the two.
          scale_init: initializer of the zero-centred scale (default zeros).
          scale_metadata: metadata of the ``scale`` Param, e.g. sharding names.
          rngs: ``nnx.Rngs``.
          **kwargs: any other argument of :class:`RMSNorm` (``reduction_axes``,
            ``implementation``, ...), except ``scale_offset`` and ``promote_dtype``,
            which this constructor fixes.

        Example:

        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from rmsnorm_jax.nnx import RMSNorm
        >>> norm = RMSNorm.gemma(4, weight_dtype=jnp.float32, rngs=nnx.Rngs(0))
        >>> norm.scale[...]  # Gemma's zeros: the layer starts at unit gain
        Array([0., 0., 0., 0.], dtype=float32)
        >>> norm.scale[...] = jnp.array([0.0, 1.0, 0.0, -1.0])  # a checkpoint's scale
        >>> y = norm(jnp.array([[1.0, 2.0, 3.0, 4.0]]))  # x_hat * (1 + scale)
        >>> [round(v, 2) for v in y[0].tolist()]
        [0.37, 1.46, 1.1, 0.0]
        >>> RMSNorm.gemma(4, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))(y).dtype
        dtype(bfloat16)
        """
        fixed = sorted({"scale_offset", "promote_dtype"} & kwargs.keys())
        if fixed:
            raise TypeError(
                f"RMSNorm.gemma fixes {', '.join(fixed)} (scale_offset=1.0, "
                "promote_dtype=None); drop them, or build RMSNorm(...) directly."
            )
        if weight_dtype is not None and param_dtype is not None:
            if jnp.dtype(weight_dtype) != jnp.dtype(param_dtype):
                raise ValueError(
                    f"weight_dtype={weight_dtype!r} and param_dtype={param_dtype!r} name "
                    "the same thing (the scale's storage dtype); give one of them."
                )
        storage = weight_dtype or param_dtype or jnp.float32
        return cls(
            num_features,
            epsilon=epsilon,
            dtype=dtype,
            param_dtype=storage,
            scale_init=scale_init,
            scale_metadata=scale_metadata,
            scale_offset=1.0,
            promote_dtype=None,
            rngs=rngs,
            **kwargs,
        )

    def __call__(
        self,
        x: jax.Array,
        mask: jax.Array | None = None,
        *,
        residual: jax.Array | None = None,
        gate: jax.Array | None = None,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """Normalizes ``x``. ``mask``: optional boolean array broadcastable to ``x``; the
        mean square is taken over its True positions (flax's masked statistics).
        ``residual``: normalizes ``x + residual`` and returns ``(y, h)``; ``gate``: the
        gated norm. The parameters are the same in every form."""
        x = jnp.asarray(x)
        feature_shape, broadcast_shape = feature_param_shapes(x.shape, self.feature_axes)
        if math.prod(feature_shape) != self.num_features:
            raise ValueError(
                f"x has {math.prod(feature_shape)} features on feature_axes="
                f"{self.feature_axes!r} (shape {x.shape}) but the module was built with "
                f"num_features={self.num_features}."
            )
        scale = None if self.scale is None else self.scale[...]
        bias = None if self.bias is None else self.bias[...]
        if self.promote_dtype is not None and bias is None:
            x, scale = self.promote_dtype((x, scale), dtype=self.dtype)
        elif self.promote_dtype is not None:
            x, scale, bias = self.promote_dtype((x, scale, bias), dtype=self.dtype)
        return normalize(
            self,
            x,
            None if scale is None else scale.reshape(broadcast_shape),
            None if bias is None else bias.reshape(broadcast_shape),
            mask,
            residual,
            gate,
        )
