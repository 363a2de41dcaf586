"""``rms_norm``, the public function: its arguments are checked by ``_config.py``; the path
that computes it, XLA (``_xla/rms_norm.py``) or a backend's kernels, is chosen by
``kernels/_select.py`` (``route``, ``select``)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import jax

from ._config import as_float_array, norm_config
from ._xla import rms_norm_core
from .kernels._ops import rms_norm_kernel
from .kernels._select import route


def rms_norm(
    x: Any,
    scale: Any = None,
    eps: float = 1e-6,
    *,
    bias: Any = None,
    axis: int | Sequence[int] = -1,
    p: float = 1.0,
    scale_offset: float = 0.0,
    eps_placement: str = "inside",
    dtype: Any = None,
    axis_name: Hashable | None = None,
    mask: Any = None,
    implementation: str = "auto",
) -> jax.Array:
    r"""Root-mean-square layer normalisation (Zhang & Sennrich, 2019), with pRMSNorm.

    For each row (the elements of ``x`` over ``axis``, ``n`` of them, row-major)::

        k    = ceil(n * p)                         # p = 1: all n
        ms   = (1/k) * sum_{i<k} x_i**2
        r    = rsqrt(ms + eps)                     # eps_placement="inside"
        r    = 1 / (sqrt(ms) + eps)                # eps_placement="outside"
        y    = (scale + scale_offset) * (x * r) + bias

    With ``mask`` (flax's masked statistics) the mean square is taken over the row's
    positions where the mask is True, ``ms = sum(mask * x**2) / sum(mask)``, and
    every position is normalized by it; masked-out values (even NaN or Inf) do not
    touch the statistic. A row with no True position has ``ms = 0``, like an all-zero
    row (finite, eps-limited).

    The gradient is the analytic backward pass (reverse mode transposes the tangent
    map into it: ``docs/derivatives.md``); the residuals it keeps are ``x``, ``scale``
    and one float32 per row, nothing else of full size (plus ``mask`` in its given,
    possibly broadcast, shape and dtype, when one is given). It composes with ``jit``,
    ``vmap``, ``lax.scan``, ``jax.checkpoint``, forward mode (``jax.jvp``,
    ``jax.jacfwd``, ``jax.linearize``), grad-of-grad and ``jax.hessian``.

    Dtypes: the statistics and the normalisation are computed in
    ``promote_types(result_type(x, scale, bias), float32)`` (float64 stays float64),
    whatever the input dtype, so float16 input up to its max (65504) is safe. ``y`` has
    dtype ``dtype`` if given, else ``result_type(x, scale, bias)`` (flax's rule).
    Gradients are accumulated in the compute dtype and returned in each input's dtype.

    Args:
      x: floating array of any shape.
      scale: optional gain, any shape that broadcasts to ``x`` (usually the feature
        shape). ``None`` means 1 (then ``scale_offset`` is ignored).
      eps: static float >= 0 added to the mean square (or to the RMS).
      bias: optional shift, any shape that broadcasts to ``x``.
      axis: int or tuple of ints (negative allowed): the normalized axes.
      p: static fraction in (0, 1]; the RMS comes from the first ``ceil(n * p)``
        elements of each row and is applied to all ``n``.
      scale_offset: static float added to ``scale``; 1.0 with a zero-initialised scale
        is Gemma's ``(1 + scale)``.
      eps_placement: ``"inside"`` (LLaMA, T5, flax, torch) or ``"outside"`` (the
        paper's reference code).
      dtype: output dtype; default is the promotion of ``x``, ``scale`` and ``bias``.
      axis_name: mapped axis name (or tuple of names) of ``shard_map``/``pmap``
        across which the normalized features are split: the sums of the statistic
        and of the backward cross term are ``psum``-ed over it. With ``p < 1`` the
        first ``k`` features are counted globally, which needs a single normalized
        axis split in device order.
      mask: optional boolean array that broadcasts to ``x`` (other dtypes raise); an
        element enters the mean square where it is True. Not differentiated. Not
        combined with ``p < 1`` or ``axis_name`` (raises: the meaning is ambiguous).
      implementation: which path computes the norm. ``"xla"``: XLA's fusions of the
        jnp expression. ``"pallas"``: the fused Pallas kernels (``rmsnorm_jax.kernels``),
        one pass forward and one backward, where the call fits them (the last axis
        normalized alone, no ``mask`` or ``axis_name``, float32/bfloat16/float16 input,
        ``scale`` and ``bias`` of one value per feature, a row that fits a kernel
        block); otherwise XLA. ``"mosaic_gpu"``, ``"triton"``, ``"mosaic_tpu"``: that
        backend's kernels alone, on its platform (to compare backends); XLA elsewhere.
        ``"auto"`` (default): the kernels only where a
        measurement on hardware found them faster on the device and jax in use
        (``rmsnorm_jax.kernels.MEASURED``, ``docs/kernels.md``), XLA everywhere else;
        ``rmsnorm_jax.kernels.explain(rms_norm, x, ...)`` says which path a call takes
        and why.

    Returns:
      ``y`` with the shape of ``x``.

    Raises:
      TypeError, ValueError: for a non-floating ``x``, a ``scale``, ``bias`` or
        ``mask`` that does not broadcast, a floating ``mask``, ``mask`` with ``p < 1``
        or ``axis_name``, ``p`` outside (0, 1], a negative, NaN or traced ``eps``,
        bad axes, an empty normalized axis, an unknown ``eps_placement`` or
        ``implementation``.

    Example:

    >>> import jax.numpy as jnp
    >>> from rmsnorm_jax import rms_norm
    >>> x = jnp.array([[1.0, 2.0, 3.0, 4.0], [-1.0, -2.0, -3.0, -4.0]])
    >>> rms_norm(x, eps=0.0).round(4)
    Array([[ 0.3651,  0.7303,  1.0954,  1.4606],
           [-0.3651, -0.7303, -1.0954, -1.4606]], dtype=float32)
    >>> rms_norm(x, jnp.ones(4), p=0.5).shape   # pRMSNorm from the first 2 features
    (2, 4)
    """
    x = as_float_array("x", x)
    cfg, scale, bias, mask = norm_config(
        x, scale, eps, bias, axis, p, scale_offset, eps_placement, dtype, axis_name, mask
    )
    path = route("rms_norm", implementation, cfg, x, scale, bias, mask)
    if path.spec is not None:
        return rms_norm_kernel(cfg, path.spec, path.request, x, scale, bias)
    return rms_norm_core(cfg, x, scale, bias, mask)
