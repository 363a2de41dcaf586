"""Masked statistics (flax's ``mask=``): rms_norm against the float64 masked formula,
and the Modules against flax.linen.RMSNorm / flax.nnx.RMSNorm with a mask."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_close, multi_device_mesh, oracle_value_and_grads, tol
from jax.test_util import check_grads

import rmsnorm_jax
import rmsnorm_jax.nnx
from rmsnorm_jax import rms_norm


def _inputs(shape, mask_shape, dtype, seed=0, all_masked_row=True):
    kx, km, ks, kb, kc = jax.random.split(jax.random.key(seed), 5)
    x = (2.0 * jax.random.normal(kx, shape, jnp.float32) + 0.5).astype(dtype)
    mask = jax.random.bernoulli(km, 0.6, mask_shape)
    if all_masked_row:
        mask = mask.at[(0,) * (len(mask_shape) - 1)].set(False)
    scale = 1 + 0.3 * jax.random.normal(ks, shape[-1:], jnp.float32)
    bias = 0.1 * jax.random.normal(kb, shape[-1:], jnp.float32)
    ct = jax.random.normal(kc, shape, jnp.float32).astype(dtype)
    return x, mask, scale, bias, ct


def _ours(x, scale, bias, ct, **kw):
    def loss(x, scale, bias):
        return jnp.sum((rms_norm(x, scale, bias=bias, **kw) * ct).astype(jnp.float32))

    return rms_norm(x, scale, bias=bias, **kw), jax.grad(loss, (0, 1, 2))(x, scale, bias)


CASES = [
    # (x shape, mask shape, axis)
    ((4, 6, 16), (4, 6, 16), -1),
    ((4, 6, 16), (4, 6, 1), -1),  # whole rows in or out
    ((4, 6, 16), (16,), -1),  # the same features masked in every row
    ((4, 6, 16), (4, 6, 16), (1, 2)),
    ((5, 8), (5, 8), -1),
    ((1, 6, 16), (6, 16), -1),  # a batch of one the mask does not reach
    ((1, 6, 16), (1, 6, 16), -1),
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("placement", ["inside", "outside"])
@pytest.mark.parametrize("shape, mask_shape, axis", CASES)
def test_against_float64_oracle(x64, dtype, placement, shape, mask_shape, axis):
    x, mask, scale, bias, ct = _inputs(shape, mask_shape, dtype)
    kw = dict(axis=axis, eps=1e-3, eps_placement=placement, mask=mask)
    y, grads = _ours(x, scale, bias, ct, **kw)
    y64, grads64 = oracle_value_and_grads(x, scale, bias, ct, **kw)
    t = tol(dtype)
    assert y.dtype == jnp.promote_types(dtype, jnp.float32)
    assert_close(y, y64, **t)
    for got, want in zip(grads, grads64, strict=True):
        assert_close(got, want, **t)


def test_check_grads_reverse_mode(x64):
    x, mask, scale, bias, _ = _inputs((3, 7), (3, 7), jnp.float64)
    f = lambda x, s, b: rms_norm(x, s, bias=b, eps=1e-3, mask=mask)
    check_grads(f, (x, scale.astype(jnp.float64), bias.astype(jnp.float64)), 2, modes=["rev"])


def test_masked_values_do_not_touch_the_statistic():
    x, mask, scale, _, _ = _inputs((6, 32), (6, 32), jnp.float32, all_masked_row=False)
    poisoned = jnp.where(mask, x, jnp.array([jnp.nan, jnp.inf, -jnp.inf, 1e30])[jnp.arange(32) % 4])
    clean = jnp.where(mask, x, 0.0)
    y_poisoned = rms_norm(poisoned, scale, mask=mask)
    y_clean = rms_norm(clean, scale, mask=mask)
    np.testing.assert_array_equal(np.where(mask, y_poisoned, 0), np.where(mask, y_clean, 0))
    assert np.isfinite(np.where(mask, y_poisoned, 0)).all()


@pytest.mark.parametrize("placement", ["inside", "outside"])
def test_all_masked_row_is_like_an_all_zero_row(placement):
    x = jnp.array([[3.0, -4.0, 5.0], [1.0, 2.0, 2.0]])
    mask = jnp.array([[False, False, False], [True, True, False]])
    eps = 0.25
    y = rms_norm(x, eps=eps, eps_placement=placement, mask=mask)
    inv0 = 1 / np.sqrt(eps) if placement == "inside" else 1 / eps  # ms = 0
    ms1 = (1 + 4) / 2  # by hand: the first two elements of row 1
    inv1 = 1 / np.sqrt(ms1 + eps) if placement == "inside" else 1 / (np.sqrt(ms1) + eps)
    np.testing.assert_allclose(y, np.array([[3, -4, 5], [1, 2, 2]]) * [[inv0], [inv1]], rtol=1e-6)
    dx = jax.grad(lambda x: jnp.sum(rms_norm(x, eps=eps, eps_placement=placement, mask=mask)))(x)
    assert np.isfinite(dx).all()
    np.testing.assert_allclose(dx[0], inv0, rtol=1e-6)  # no element in S: no cross term


def test_residuals_are_x_scale_mask_and_a_float_per_row():
    x = jnp.ones((64, 128), jnp.bfloat16)
    scale = jnp.ones((128,), jnp.float32)
    mask = jnp.ones((64, 1), bool)
    _, vjp = jax.vjp(lambda x, s: rms_norm(x, s, mask=mask), x, scale)
    kept = sum(leaf.nbytes for leaf in jax.tree.leaves(vjp))
    assert kept == x.nbytes + scale.nbytes + mask.nbytes + 64 * 4


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float32, jnp.uint8])
def test_a_mask_must_be_boolean(dtype):
    """An integer 0/1/2 or float mask is refused (never read as "non-zero"), naming the fix."""
    x, mask, scale, _, _ = _inputs((4, 8), (4, 8), jnp.float32)
    with pytest.raises(TypeError, match=r"mask must be a boolean array.*astype\(bool\)"):
        rms_norm(x, scale, mask=mask.astype(dtype) * 2)


@pytest.mark.parametrize(
    "kw, error, match",
    [
        (dict(mask=jnp.ones((4, 8), jnp.float32)), TypeError, "mask must be a boolean"),
        (dict(mask=jnp.ones((4, 9), bool)), ValueError, r"mask with shape \(4, 9\)"),
        (dict(mask=jnp.ones((4, 8), bool), p=0.5), ValueError, "ambiguous"),
    ],
)
def test_bad_masks(kw, error, match):
    with pytest.raises(error, match=match):
        rms_norm(jnp.ones((4, 8)), **kw)


def test_mask_with_axis_name_raises():
    with multi_device_mesh((2,), ("model",)) as mesh:
        mask = jnp.ones((4, 8), bool)

        def fn(x):
            return rms_norm(x, axis_name="model", mask=mask[:, :4])

        with pytest.raises(ValueError, match="mask with axis_name='model'"):
            jax.shard_map(
                fn, mesh=mesh, in_specs=jax.P(None, "model"), out_specs=jax.P(None, "model")
            )(jnp.ones((4, 8)))


# ---------------------------------------------------------------- the Modules against flax


@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("mask_shape", [(4, 6, 16), (4, 6, 1), (16,)])
@pytest.mark.parametrize("reduction_axes", [-1, (1, 2)])
def test_linen_matches_flax_with_a_mask(x_dtype, mask_shape, reduction_axes):
    # flax gives NaN for a row with no True position; we give a finite row, so the
    # comparison uses masks with at least one True per row.
    x, mask, _, _, ct = _inputs((4, 6, 16), mask_shape, x_dtype, all_masked_row=False)
    mask = mask.at[..., 0].set(True)
    kw = dict(epsilon=1e-5, reduction_axes=reduction_axes)
    theirs, ours = nn.RMSNorm(**kw), rmsnorm_jax.RMSNorm(**kw)
    variables = theirs.init(jax.random.key(0), x)
    variables = jax.tree.map(lambda a: a + 0.1 * jnp.arange(a.size).reshape(a.shape), variables)

    def value_and_grads(layer):
        def loss(v, x):
            return jnp.sum((layer.apply(v, x, mask=mask) * ct).astype(jnp.float32))

        return layer.apply(variables, x, mask=mask), jax.grad(loss, (0, 1))(variables, x)

    (y_ours, g_ours), (y_theirs, g_theirs) = value_and_grads(ours), value_and_grads(theirs)
    assert y_ours.dtype == y_theirs.dtype
    t = tol(jnp.float32 if x_dtype == jnp.float32 else jnp.bfloat16)
    assert_close(y_ours, y_theirs, **t)
    for a, b in zip(jax.tree.leaves(g_ours), jax.tree.leaves(g_theirs), strict=True):
        assert_close(a, b, **t)


@pytest.mark.parametrize("mask_shape", [(4, 6, 16), (4, 6, 1)])
def test_nnx_matches_flax_nnx_with_a_mask(mask_shape):
    x, mask, _, _, _ = _inputs((4, 6, 16), mask_shape, jnp.float32, all_masked_row=False)
    mask = mask.at[..., 0].set(True)
    ours = rmsnorm_jax.nnx.RMSNorm(16, rngs=nnx.Rngs(0))
    theirs = nnx.RMSNorm(16, rngs=nnx.Rngs(0))
    nnx.update(theirs, jax.tree.map(lambda a: a * 1.3, nnx.state(theirs, nnx.Param)))
    nnx.update(ours, nnx.state(theirs, nnx.Param))
    assert_close(ours(x, mask=mask), theirs(x, mask=mask), **tol(jnp.float32))
    linen = rmsnorm_jax.RMSNorm()
    np.testing.assert_array_equal(
        ours(x, mask=mask),
        linen.apply({"params": {"scale": ours.scale[...]}}, x, mask=mask),
    )


# ---------------------------------------------------------------- NNX dtype promotion


@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("dtype", [None, jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
def test_nnx_promotes_dtypes_like_flax(x_dtype, dtype, param_dtype):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0))
    ours, theirs = rmsnorm_jax.nnx.RMSNorm(64, **kw), nnx.RMSNorm(64, **kw)
    nnx.update(theirs, jax.tree.map(lambda a: a * 1.1, nnx.state(theirs, nnx.Param)))
    nnx.update(ours, nnx.state(theirs, nnx.Param))
    x = (3 * jax.random.normal(jax.random.key(0), (64, 64), jnp.float32)).astype(x_dtype)
    y_ours, y_theirs = ours(x), theirs(x)
    assert y_ours.dtype == y_theirs.dtype
    if y_theirs.dtype == jnp.float32:
        assert_close(y_ours, y_theirs, **tol(jnp.float32))
        return
    # Both normalize the same promoted (cast) input in float32 and round once to the
    # output dtype; the float32 results differ in the last bits (summation order), so
    # an output can land one rounding step of its dtype away, rarely.
    a, b = np.asarray(y_ours, np.float64), np.asarray(y_theirs, np.float64)
    step = np.abs(b) * float(jnp.finfo(y_theirs.dtype).eps)
    assert (np.abs(a - b) <= step).all()
    assert np.mean(a != b) < 0.02, np.mean(a != b)


def test_nnx_promote_dtype_none_means_no_cast():
    layer = rmsnorm_jax.nnx.RMSNorm(8, dtype=jnp.bfloat16, promote_dtype=None, rngs=nnx.Rngs(0))
    x = jnp.linspace(-3, 3, 16, dtype=jnp.float32).reshape(2, 8) * 1.001
    expected = rms_norm(x, layer.scale[...], 1e-6, dtype=jnp.bfloat16)
    np.testing.assert_array_equal(layer(x), expected)
