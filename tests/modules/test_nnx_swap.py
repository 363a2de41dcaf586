"""The one-line NNX swap for models with their own zero-centred norm (issue 20).

``rmsnorm_jax.nnx.RMSNorm.gemma`` takes Gemma's argument names and its ``(1 + scale)``
semantics (MaxText's own norm is ``x_hat * scale``:
tests/integrations/test_integrations.py); the trap
it avoids is a zero-centred scale read as ``x_hat * scale``. The oracle is each model's
own formula, written here in float64.
"""

import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_close, offset_normal, tol

from rmsnorm_jax.nnx import RMSNorm

pytestmark = pytest.mark.newest

EPS = 1e-6


def gemma_formula64(x, scale):
    """Gemma's norm, float64: ``x / sqrt(mean(x**2) + eps) * (1 + scale)``."""
    x = jnp.asarray(x, jnp.float64)
    scale = jnp.asarray(scale, jnp.float64)
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + EPS) * (1 + scale)


class GemmaStyleNorm(nnx.Module):
    """A model's own zero-centred norm, as Gemma's NNX code writes it."""

    def __init__(self, dim, *, weight_dtype=jnp.float32, scale_metadata=None, rngs):
        del rngs
        self.scale = nnx.Param(jnp.zeros((dim,), weight_dtype), **(scale_metadata or {}))

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + EPS)
        return (y * (1 + self.scale[...])).astype(x.dtype)


class Block(nnx.Module):
    """Pre- and post-norm around a linear map; the norm class is the model's choice."""

    def __init__(self, dim, norm_cls, *, rngs):
        meta = {"tag": "norm_scale"}
        self.pre = norm_cls(dim, weight_dtype=jnp.float32, scale_metadata=meta, rngs=rngs)
        self.linear = nnx.Linear(dim, dim, rngs=rngs)
        self.post = norm_cls(dim, weight_dtype=jnp.float32, scale_metadata=meta, rngs=rngs)

    def __call__(self, x):
        return x + self.post(self.linear(self.pre(x)))


def _x(shape=(3, 5, 16), dtype=jnp.float32, seed=0):
    return offset_normal(shape, dtype, seed)


def _trained_scales(module, seed=1):
    """Zero-centred scales as a checkpoint holds them (not the zeros of the init)."""
    state = nnx.state(module, nnx.Param)
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    keys = jax.random.split(jax.random.key(seed), len(paths_leaves))
    new = [
        (0.5 * jax.random.normal(k, a.shape, jnp.float32)).astype(a.dtype)
        if "scale" in jax.tree_util.keystr(path)
        else a
        for k, (path, a) in zip(keys, paths_leaves, strict=True)
    ]
    return jax.tree.unflatten(treedef, new)


def test_gemma_defaults_are_the_models():
    norm = RMSNorm.gemma(8, rngs=nnx.Rngs(0))
    assert norm.scale_offset == 1.0
    assert norm.epsilon == 1e-6
    np.testing.assert_array_equal(norm.scale[...], np.zeros(8, np.float32))
    assert norm.scale[...].dtype == jnp.float32
    bf = RMSNorm.gemma(8, weight_dtype=jnp.bfloat16, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert bf.scale[...].dtype == jnp.bfloat16
    assert bf(_x((2, 8))).dtype == jnp.bfloat16


@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
def test_gemma_loads_one_plus_scale_parameters(x_dtype):
    norm = RMSNorm.gemma(16, dtype=x_dtype, rngs=nnx.Rngs(0))
    scale = 0.5 * jax.random.normal(jax.random.key(3), (16,), jnp.float32)
    norm.scale[...] = scale
    x = _x(dtype=x_dtype)
    ct = jax.random.normal(jax.random.key(4), x.shape, jnp.float32)

    def loss(module, x):
        return jnp.sum(module(x).astype(jnp.float32) * ct)

    y = norm(x)
    grads, dx = nnx.grad(loss, argnums=(0, 1))(norm, x)
    with jax.enable_x64(True):
        x64, s64, ct64 = (jnp.asarray(a, jnp.float64) for a in (x, scale, ct))
        want = gemma_formula64(x64, s64)
        dx64, ds64 = jax.grad(lambda x, s: jnp.sum(gemma_formula64(x, s) * ct64), argnums=(0, 1))(
            x64, s64
        )
        assert y.dtype == x_dtype
        assert_close(y, want, **tol(x_dtype))
        assert_close(dx, dx64, **tol(x_dtype))
        assert_close(grads.scale[...], ds64, **tol(x_dtype))


def test_one_line_swap_in_a_gemma_style_model():
    """The same Block, built with the model's own norm and with the swap, on the same
    (trained, zero-centred) parameters: equal outputs and gradients."""
    own = Block(16, GemmaStyleNorm, rngs=nnx.Rngs(0))
    swapped = Block(16, RMSNorm.gemma, rngs=nnx.Rngs(0))
    params = _trained_scales(own)
    nnx.update(own, params)
    nnx.update(swapped, params)
    assert swapped.pre.scale.get_metadata()["tag"] == "norm_scale"
    x = _x()
    assert_close(swapped(x), own(x), **tol(jnp.float32))

    def loss(model, x):
        return jnp.sum(jnp.sin(model(x)))

    g_own = nnx.grad(loss)(own, x)
    g_swapped = nnx.grad(loss)(swapped, x)
    for a, b in zip(jax.tree.leaves(g_swapped), jax.tree.leaves(g_own), strict=True):
        assert_close(a, b, **tol(jnp.float32))
    # The gradient of the scales is that of the float64 formula too (not trivially 0).
    with jax.enable_x64(True):
        h = np.asarray(own.pre(x), np.float64)
        assert_close(own.pre(x), gemma_formula64(x, own.pre.scale[...]), **tol(jnp.float32))
        assert np.abs(h).max() > 0


@pytest.mark.parametrize("init", ["zeros", "ones"])
def test_builds_like_flax_with_any_initializer_and_no_warning(init):
    """What flax's own parametrized layer tests do (linear_test.py, TestLayersSameGraph,
    warnings as errors): the layer built with zeros or ones initializers has flax's
    parameters, metadata and outputs, and warns about nothing (flax does not)."""
    initializer = getattr(nnx.initializers, init)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = RMSNorm(16, scale_init=initializer, rngs=nnx.Rngs(0))
        theirs = nnx.RMSNorm(16, scale_init=initializer, rngs=nnx.Rngs(0))
        ours_state, theirs_state = nnx.state(ours, nnx.Param), nnx.state(theirs, nnx.Param)
        assert jax.tree.structure(ours_state) == jax.tree.structure(theirs_state)
        chex.assert_trees_all_equal(ours_state, theirs_state)
        assert type(ours.scale) is type(theirs.scale)
        np.testing.assert_allclose(ours(_x()), theirs(_x()), rtol=1e-6, atol=1e-6)
        # The trap is documented, not warned about: with zero scales, x_hat * scale is 0.
        if init == "zeros":
            np.testing.assert_array_equal(ours(_x()), np.zeros((3, 5, 16), np.float32))
        RMSNorm.gemma(16, rngs=nnx.Rngs(0))
        nnx.eval_shape(lambda: RMSNorm(16, scale_init=initializer, rngs=nnx.Rngs(0)))


def test_the_trap_on_loaded_parameters_is_wrong_by_far():
    """Why RMSNorm.gemma exists: trained zero-centred scales read as ``x_hat * s``."""
    trap = Block(16, _renaming_factory, rngs=nnx.Rngs(0))
    own = Block(16, GemmaStyleNorm, rngs=nnx.Rngs(0))
    params = _trained_scales(own)
    nnx.update(own, params)
    nnx.update(trap, params)
    x = _x()
    err = jnp.linalg.norm(trap(x) - own(x)) / jnp.linalg.norm(own(x))
    assert err > 0.3


def _renaming_factory(dim, *, weight_dtype, scale_metadata, rngs):
    # The factory of the issue: renames the arguments, keeps the zeros init, forgets
    # scale_offset=1.0.
    return RMSNorm(
        dim,
        param_dtype=weight_dtype,
        scale_init=nnx.initializers.zeros,
        scale_metadata=scale_metadata,
        rngs=rngs,
    )


def test_gemma_argument_errors():
    with pytest.raises(ValueError, match=r"weight_dtype.*param_dtype"):
        RMSNorm.gemma(8, weight_dtype=jnp.float32, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="scale_offset"):
        RMSNorm.gemma(8, scale_offset=0.0, rngs=nnx.Rngs(0))
    RMSNorm.gemma(8, weight_dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))


def test_implementation_is_stored_and_checked():
    assert RMSNorm(8, rngs=nnx.Rngs(0)).implementation == "auto"
    assert RMSNorm.gemma(8, implementation="xla", rngs=nnx.Rngs(0)).implementation == "xla"
    with pytest.raises(ValueError, match=r"implementation must be one of .*'auto'.*got 'cuda'"):
        RMSNorm(8, implementation="cuda", rngs=nnx.Rngs(0))
