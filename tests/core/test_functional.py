"""rms_norm against the float64 plain formula under jax.grad, hand values and check_grads."""

import math

import chex
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, offset_normal, oracle_value_and_grads, to64, tol
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads

from rmsnorm_jax import partial_count, rms_norm

pytestmark = pytest.mark.oldest


def _inputs(shape, scale_shape, bias_shape, dtype, seed=0):
    kx, ks, kb, kc = jax.random.split(jax.random.key(seed), 4)
    f32 = jnp.float32
    x = (2.0 * jax.random.normal(kx, shape, f32) + 0.5).astype(dtype)
    scale = None if scale_shape is None else 1 + 0.3 * jax.random.normal(ks, scale_shape, f32)
    bias = None if bias_shape is None else 0.1 * jax.random.normal(kb, bias_shape, f32)
    ct = jax.random.normal(kc, shape, f32).astype(dtype)
    return x, scale, bias, ct


def _ours_value_and_grads(x, scale, bias, ct, **kw):
    def loss(x, scale, bias):
        return jnp.sum((rms_norm(x, scale, bias=bias, **kw) * ct).astype(jnp.float32))

    y = rms_norm(x, scale, bias=bias, **kw)
    return y, jax.grad(loss, argnums=(0, 1, 2))(x, scale, bias)


# ---------------------------------------------------------------- hand-computed values


def test_worked_example_two_rows():
    x = jnp.array([[1.0, 2, 3, 4], [-1, -2, -3, -4]])
    y = rms_norm(x, jnp.ones(4), eps=0.0)
    expected = np.array([[0.3651, 0.7303, 1.0954, 1.4606]])
    np.testing.assert_allclose(y, np.concatenate([expected, -expected]), atol=1e-4)
    # RMS = sqrt(7.5) for both rows, so y * sqrt(7.5) == x.
    np.testing.assert_allclose(y * math.sqrt(7.5), x, rtol=1e-6)


def test_worked_example_with_gain():
    x = jnp.array([2.0, 4, 6, 8])
    g = jnp.array([1.2, 0.8, 1.0, 1.5])
    y = rms_norm(x, g, eps=1e-5)
    # FACTS.md lists y[3] = 2.192, which is 1.5 * the rounded xhat 1.461; the exact
    # value is 1.5 * 8 / sqrt(30 + 1e-5) = 2.19089.
    np.testing.assert_allclose(y, [0.438178, 0.584237, 1.095445, 2.190890], atol=1e-6)
    np.testing.assert_allclose(rms_norm(x, eps=1e-5), [0.365, 0.730, 1.095, 1.461], atol=1e-3)


def test_partial_by_hand():
    # k = ceil(4 * 0.5) = 2: RMS from [3, 4] is sqrt(12.5); applied to all four.
    x = jnp.array([3.0, 4.0, 10.0, -10.0])
    y = rms_norm(x, p=0.5, eps=0.0)
    np.testing.assert_allclose(y, np.array([3, 4, 10, -10]) / math.sqrt(12.5), rtol=1e-6)


def test_outside_placement_by_hand():
    x = jnp.array([3.0, 4.0])  # RMS = sqrt(12.5)
    y = rms_norm(x, eps=0.5, eps_placement="outside")
    np.testing.assert_allclose(y, np.array([3, 4]) / (math.sqrt(12.5) + 0.5), rtol=1e-6)
    y_in = rms_norm(x, eps=0.5)
    np.testing.assert_allclose(y_in, np.array([3, 4]) / math.sqrt(12.5 + 0.5), rtol=1e-6)


@pytest.mark.parametrize(
    "n, p, k",
    [
        (100, 0.07, 7),
        (512, 0.0625, 32),
        (100, 0.0625, 7),
        (10, 0.1, 1),
        (3, 1 / 3, 1),
        (7, 1.0, 7),
        (1, 0.01, 1),
        (1000, 0.001, 1),
        (49, 0.29, 15),
        (100, 0.57, 57),
    ],
)
def test_partial_count(n, p, k):
    assert partial_count(n, p) == k


# ---------------------------------------------------------------- against the oracle

CASES = [
    # shape, axis, scale_shape, bias_shape
    ((6, 16), -1, (16,), None),
    ((2, 3, 8), -1, (8,), (8,)),
    ((2, 3, 8), (1, 2), (3, 8), None),
    ((2, 3, 8), (-2, -1), (8,), (3, 8)),
    ((4, 5, 6), 0, (4, 1, 1), None),
    ((4, 5, 6), (0, 2), (1, 1, 6), (6,)),
    ((3, 7), -1, None, None),
    ((2, 3, 8), -1, (3, 8), (2, 3, 8)),  # scale with a batch axis too
    ((5,), 0, (), ()),  # scalar scale and bias
    # size-1 axes: the core drops those no parameter reaches (a batch of one), keeps others
    ((1, 5, 16), -1, (16,), (16,)),
    ((1, 4, 1, 8), -1, (8,), None),
    ((1, 6, 8), 1, (6, 1), None),
    ((3, 1, 8), -1, (1, 8), None),  # reached by the scale: kept
    ((1, 1, 8), (1, 2), (1, 8), (8,)),  # a normalized size-1 axis: kept
]


@pytest.mark.parametrize("shape, axis, scale_shape, bias_shape", CASES)
@pytest.mark.parametrize("p", [1.0, 0.5, 0.0625])
@pytest.mark.parametrize("placement", ["inside", "outside"])
def test_matches_oracle_float32(x64, shape, axis, scale_shape, bias_shape, p, placement):
    x, scale, bias, ct = _inputs(shape, scale_shape, bias_shape, jnp.float32)
    kw = dict(eps=1e-5, axis=axis, p=p, eps_placement=placement, scale_offset=0.25)
    y, grads = _ours_value_and_grads(x, scale, bias, ct, **kw)
    y64, grads64 = oracle_value_and_grads(x, scale, bias, ct, **kw)
    assert y.dtype == jnp.float32
    assert_close(y, y64, **tol(jnp.float32))
    for g, g64, primal in zip(grads, grads64, (x, scale, bias), strict=True):
        if primal is not None:
            assert g.shape == primal.shape and g.dtype == primal.dtype
        assert_close(g, g64, **tol(jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("p", [1.0, 0.25])
def test_low_precision_inputs(x64, dtype, param_dtype, p):
    x, scale, bias, ct = _inputs((8, 4, 64), (64,), (64,), dtype, seed=3)
    scale, bias = scale.astype(param_dtype), bias.astype(param_dtype)
    kw = dict(eps=1e-6, p=p)
    y, grads = _ours_value_and_grads(x, scale, bias, ct, **kw)
    y64, grads64 = oracle_value_and_grads(x, scale, bias, ct, **kw)
    assert y.dtype == jnp.result_type(x, scale, bias)
    coarsest = max(jnp.finfo(dtype).eps, jnp.finfo(param_dtype).eps)
    tolerance = tol(jnp.bfloat16 if coarsest > 1e-3 else dtype)
    assert_close(y, y64, **tolerance)
    for g, g64, primal in zip(grads, grads64, (x, scale, bias), strict=True):
        assert g.dtype == primal.dtype
        assert_close(g, g64, **tolerance)


def test_explicit_output_dtype():
    x = jax.random.normal(jax.random.key(0), (4, 32))
    y = rms_norm(x, jnp.ones(32, jnp.float32), dtype=jnp.bfloat16)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        y.astype(jnp.float32), rms_norm(x, jnp.ones(32)), rtol=1e-2, atol=1e-2
    )


def test_float64_stays_float64(x64):
    x, scale, bias, ct = _inputs((3, 10), (10,), (10,), jnp.float64)
    scale, bias = to64((scale, bias))
    y, grads = _ours_value_and_grads(x, scale, bias, ct, p=0.3)
    y64, grads64 = oracle_value_and_grads(x, scale, bias, ct, p=0.3)
    assert y.dtype == jnp.float64
    assert_close(y, y64, **tol(jnp.float64))
    for g, g64 in zip(grads, grads64, strict=True):
        assert g.dtype == jnp.float64
        assert_close(g, g64, **tol(jnp.float64))


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    shape=hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=6),
    p=st.floats(0.01, 1.0),
    placement=st.sampled_from(["inside", "outside"]),
    offset=st.sampled_from([0.0, 1.0]),
    use_scale=st.booleans(),
    use_bias=st.booleans(),
    eps=st.sampled_from([1e-6, 1e-3, 0.1]),
)
def test_property_random_combinations(data, shape, p, placement, offset, use_scale, use_bias, eps):
    ndim = len(shape)
    axes = data.draw(st.lists(st.integers(0, ndim - 1), min_size=1, max_size=ndim, unique=True))
    axis = tuple(a - ndim if data.draw(st.booleans()) else a for a in axes)
    feature_shape = tuple(d if i in axes else 1 for i, d in enumerate(shape))
    seed = data.draw(st.integers(0, 2**16))
    x, scale, bias, ct = _inputs(
        shape,
        feature_shape if use_scale else None,
        feature_shape if use_bias else None,
        jnp.float32,
        seed=seed,
    )
    kw = dict(eps=eps, axis=axis, p=p, eps_placement=placement, scale_offset=offset)
    with jax.enable_x64(True):
        y, grads = _ours_value_and_grads(x, scale, bias, ct, **kw)
        y64, grads64 = oracle_value_and_grads(x, scale, bias, ct, **kw)
    assert_close(y, y64, rtol=1e-4, atol=1e-4)
    for g, g64 in zip(grads, grads64, strict=True):
        assert_close(g, g64, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("placement", ["inside", "outside"])
@pytest.mark.parametrize("p", [1.0, 0.4])
def test_numerical_gradients_order_two(x64, placement, p):
    x, scale, bias, _ = _inputs((3, 5), (5,), (5,), jnp.float64, seed=7)
    scale, bias = to64((scale, bias))

    def f(x, scale, bias):
        return rms_norm(x, scale, 1e-3, bias=bias, p=p, eps_placement=placement)

    check_grads(f, (x, scale, bias), order=2, modes=["rev"], atol=1e-6, rtol=1e-6)


def test_rescaling_invariance_not_recentring():
    x = jax.random.normal(jax.random.key(1), (4, 64))
    y = rms_norm(x, eps=0.0)
    for a in (0.01, 3.0, 1000.0):
        np.testing.assert_allclose(rms_norm(a * x, eps=0.0), y, rtol=1e-5, atol=1e-6)
    assert not np.allclose(rms_norm(x + 1.0, eps=0.0), y, atol=1e-2)
    # eps == 0: the RMS of every output row is exactly 1.
    np.testing.assert_allclose(jnp.sqrt(jnp.mean(y**2, axis=-1)), 1.0, rtol=1e-6)


def test_equals_layernorm_for_zero_mean_rows():
    x = jax.random.normal(jax.random.key(2), (4, 32))
    x = x - x.mean(-1, keepdims=True)
    layer_norm = x / jnp.sqrt(x.var(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(rms_norm(x), layer_norm, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- numerics


@pytest.mark.parametrize("placement", ["inside", "outside"])
def test_zero_row_gives_zeros_and_finite_gradients(placement):
    x = jnp.zeros((2, 8)).at[1].set(jnp.arange(8.0))
    g = jnp.full((8,), 2.0)
    y = rms_norm(x, g, 1e-2, eps_placement=placement)
    np.testing.assert_array_equal(y[0], 0.0)
    dx, dg = jax.grad(
        lambda x, g: jnp.sum(rms_norm(x, g, 1e-2, eps_placement=placement)), argnums=(0, 1)
    )(x, g)
    assert np.isfinite(dx).all() and np.isfinite(dg).all()
    # At x == 0 the cross term vanishes: dx = scale * r with r = rsqrt(eps) or 1/eps.
    r = 1 / math.sqrt(1e-2) if placement == "inside" else 1 / 1e-2
    np.testing.assert_allclose(dx[0], 2.0 * r, rtol=1e-5)


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
def test_non_finite_row_leaves_other_rows_alone(bad):
    x = jax.random.normal(jax.random.key(3), (3, 16))
    clean_y = rms_norm(x)
    clean_dx = jax.grad(lambda x: jnp.sum(rms_norm(x) ** 2 * x))(x)
    dirty = x.at[1, 5].set(bad)
    y = rms_norm(dirty)
    dx = jax.grad(lambda x: jnp.sum(rms_norm(x) ** 2 * x))(dirty)
    for row in (0, 2):
        np.testing.assert_array_equal(y[row], clean_y[row])
        np.testing.assert_array_equal(dx[row], clean_dx[row])


def test_float16_large_values_are_finite(x64):
    x = jnp.array([[60000.0, -60000.0, 30000.0, 1.0], [300.0, 2.0, -3.0, 4.0]], jnp.float16)
    y = rms_norm(x)
    assert y.dtype == jnp.float16 and np.isfinite(np.asarray(y, np.float32)).all()
    exact = to64(x) / jnp.sqrt(jnp.mean(to64(x) ** 2, -1, keepdims=True))
    assert_close(y, exact, **tol(jnp.float16))
    # Why float32 statistics matter: in float16 x * x overflows to inf and the naive
    # formula silently returns zeros for both rows.
    naive = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    np.testing.assert_array_equal(np.asarray(naive, np.float32), 0.0)
    dx = jax.grad(lambda x: jnp.sum(rms_norm(x).astype(jnp.float32)))(x)
    assert np.isfinite(np.asarray(dx, np.float32)).all()


# ---------------------------------------------------------------- memory


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("p", [1.0, 0.0625])
def test_residuals_are_x_scale_and_one_float_per_row(dtype, p):
    x = jnp.ones((64, 256), dtype)
    scale = jnp.ones((256,), jnp.float32)
    bias = jnp.zeros((256,), jnp.float32)
    _, vjp_fn = jax.vjp(lambda x, s, b: rms_norm(x, s, bias=b, p=p), x, scale, bias)
    kept = sum(leaf.nbytes for leaf in jax.tree.leaves(vjp_fn))
    assert kept <= x.nbytes + scale.nbytes + 4 * 64


# ---------------------------------------------------------------- transformations


def _loss(x, scale):
    return jnp.sum(jnp.sin(rms_norm(x, scale, 1e-5, p=0.5)))


def test_jit_vmap_scan_checkpoint_agree(x64):
    x = jax.random.normal(jax.random.key(4), (3, 4, 8), jnp.float64)
    scale = jnp.linspace(0.5, 1.5, 8)
    expected = jax.vmap(lambda xi: jax.grad(_loss, argnums=(0, 1))(xi, scale))(x)

    per_row_jit = jax.jit(jax.vmap(jax.grad(_loss, argnums=(0, 1)), in_axes=(0, None)))
    chex.assert_trees_all_close(per_row_jit(x, scale), expected, rtol=1e-12)

    def body(carry, xi):
        return carry, jax.grad(jax.checkpoint(_loss), argnums=(0, 1))(xi, scale)

    _, scanned = jax.lax.scan(body, None, x)
    chex.assert_trees_all_close(scanned, expected, rtol=1e-12)


def test_grad_of_grad_and_hessian_match_oracle(x64):
    from rmsnorm_jax.reference import rms_norm_reference

    x = jax.random.normal(jax.random.key(5), (2, 6), jnp.float64)
    scale = jnp.linspace(0.5, 1.5, 6)

    def ours(x):
        return jnp.sum(jnp.sin(rms_norm(x, scale, 1e-4, p=0.5)))

    def theirs(x):
        return jnp.sum(jnp.sin(rms_norm_reference(x, scale, 1e-4, p=0.5)))

    chex.assert_trees_all_close(
        jax.hessian(ours)(x), jax.hessian(theirs)(x), rtol=1e-10, atol=1e-10
    )
    gg = jax.grad(lambda x: jnp.sum(jax.grad(ours)(x) ** 2))
    gg_ref = jax.grad(lambda x: jnp.sum(jax.grad(theirs)(x) ** 2))
    chex.assert_trees_all_close(gg(x), gg_ref(x), rtol=1e-10, atol=1e-10)


def test_forward_mode_against_the_plain_formula(x64):
    """jvp of rms_norm is the plain formula's jvp (forward mode: test_forward_mode.py)."""
    from rmsnorm_jax.reference import rms_norm_reference

    x = offset_normal((2, 5), jnp.float64)
    dx = offset_normal((2, 5), jnp.float64, seed=1)
    got = jax.jvp(rms_norm, (x,), (dx,))
    want = jax.jvp(rms_norm_reference, (x,), (dx,))
    chex.assert_trees_all_close(got, want, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(x=jnp.ones((2, 4), jnp.int32)), TypeError, "x must be a real floating"),
        (dict(x=jnp.ones((2, 4), bool)), TypeError, "x must be a real floating"),
        (dict(scale=jnp.ones(5)), ValueError, r"scale with shape \(5,\) does not broadcast"),
        (dict(bias=jnp.ones((3, 4))), ValueError, r"bias with shape \(3, 4\)"),
        (dict(scale=jnp.ones((1, 2, 4))), ValueError, "without enlarging"),
        (dict(scale=jnp.ones(4, jnp.int32)), TypeError, "scale must be a real floating"),
        (dict(p=0.0), ValueError, r"p must be in \(0, 1\].*got 0.0"),
        (dict(p=1.5), ValueError, r"p must be in \(0, 1\].*got 1.5"),
        (dict(p=float("nan")), ValueError, "p must be in"),
        (dict(eps=-1e-6), ValueError, "eps must be a finite float >= 0, got -1e-06"),
        (dict(eps=float("nan")), ValueError, "eps must be a finite float >= 0, got nan"),
        (dict(eps="small"), TypeError, r"eps must be a Python float \(>= 0"),
        (dict(eps=True), TypeError, "eps must be a Python float"),
        (dict(p=jnp.float32), TypeError, r"p must be a Python float \(in \(0, 1\]\)"),
        (dict(scale_offset=float("inf")), ValueError, "scale_offset must be finite"),
        (dict(axis=2), ValueError, r"axis: axis 2 is out of range for x with ndim=2"),
        (dict(axis=(1, -1)), ValueError, "repeats an axis"),
        (dict(axis=()), ValueError, r"axis=\(\) names no axis"),
        (dict(axis=1.0), TypeError, "axis must be an int"),
        (dict(eps_placement="middle"), ValueError, "eps_placement must be one of"),
        (dict(dtype=jnp.int8), TypeError, "dtype must be a floating dtype"),
        (dict(x=jnp.ones((2, 0))), ValueError, "hold no elements"),
        (dict(axis_name="model"), ValueError, "not a bound mapped axis"),
        # rms_norm(x, 1e-5) would read the epsilon as the scale.
        (dict(scale=1e-5), TypeError, r"Python number 1e-05.*rms_norm\(x, None, 1e-05\)"),
        (dict(scale=2), TypeError, "scale must be an array"),
        (dict(p="0.5"), TypeError, r"p must be a Python float \(in \(0, 1\]\), got '0.5'"),
        (dict(eps="1e-6"), TypeError, "eps must be a Python float"),
    ],
)
def test_bad_input_raises_clear_error(kwargs, error, match):
    args = dict(x=jnp.ones((2, 4)))
    args.update(kwargs)
    with pytest.raises(error, match=match):
        rms_norm(**args)


def test_traced_eps_raises():
    with pytest.raises(TypeError, match="eps is a traced value"):
        jax.jit(lambda x, eps: rms_norm(x, eps=eps))(jnp.ones((2, 4)), 1e-6)


def test_errors_come_before_xla():
    # The checks run in Python on shapes and dtypes: no compile, even under jit.
    with pytest.raises(ValueError, match="does not broadcast"):
        jax.jit(rms_norm).lower(jnp.ones((2, 4)), jnp.ones(3))
