"""add_rms_norm and gated_rms_norm against the float64 formulas under jax.grad, their
residual memory, bad input, and the names for remat policies (all three functions)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, multi_device_mesh, to64, tol
from jax.test_util import check_grads

from rmsnorm_jax import add_rms_norm, gated_rms_norm, rms_norm
from rmsnorm_jax.reference import add_rms_norm_reference, gated_rms_norm_reference


def _normal(key, shape, dtype, scale=1.0, shift=0.0):
    return (scale * jax.random.normal(key, shape, jnp.float32) + shift).astype(dtype)


def _grads(fn, args, cts):
    """Value and gradients of ``sum(out * ct)`` over every output, in float32."""

    def loss(*args):
        outs = fn(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return sum(jnp.sum((o * c).astype(jnp.float32)) for o, c in zip(outs, cts, strict=True))

    return fn(*args), jax.grad(loss, argnums=tuple(range(len(args))))(*args)


def _oracle(fn, args, cts):
    with jax.enable_x64(True):
        args64, cts64 = to64(args), to64(cts)

        def loss(*args):
            outs = fn(*args)
            outs = outs if isinstance(outs, tuple) else (outs,)
            return sum(jnp.sum(o * c) for o, c in zip(outs, cts64, strict=True))

        return fn(*args64), jax.grad(loss, argnums=tuple(range(len(args))))(*args64)


def _compare(got, want, dtype):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_close(a, b, **tol(dtype))


# ---------------------------------------------------------------- add_rms_norm


ADD_CASES = [
    dict(),
    dict(p=0.25, eps_placement="outside"),
    dict(axis=(1, 2), scale_offset=1.0),
    dict(shape=(1, 5, 16)),  # a batch of one
]


@pytest.mark.parametrize("kw", ADD_CASES)
@pytest.mark.parametrize(
    "x_dtype, r_dtype, residual_dtype",
    [
        (jnp.float32, jnp.float32, None),
        (jnp.bfloat16, jnp.float32, None),  # float32 stream under bfloat16 activations
        (jnp.bfloat16, jnp.bfloat16, jnp.float32),
        (jnp.float16, jnp.float16, None),
    ],
)
def test_add_against_float64_oracle(kw, x_dtype, r_dtype, residual_dtype):
    ks = jax.random.split(jax.random.key(0), 6)
    kw = dict(kw)
    shape = kw.pop("shape", (3, 5, 16))
    param_shape = (5, 16) if kw.get("axis") == (1, 2) else (16,)
    x, res = _normal(ks[0], shape, x_dtype, 2.0, 0.3), _normal(ks[1], shape, r_dtype, 1.5)
    scale, bias = (
        _normal(ks[2], param_shape, jnp.float32, 0.3, 1.0),
        _normal(ks[3], param_shape, jnp.float32, 0.1),
    )
    h_dtype = residual_dtype or jnp.promote_types(x_dtype, r_dtype)
    dy = _normal(ks[4], shape, jnp.promote_types(h_dtype, jnp.float32), 1.0)
    dh = _normal(ks[5], shape, h_dtype, 1.0)  # a non-zero cotangent for h too
    fn = lambda x, r, s, b: add_rms_norm(x, r, s, 1e-5, bias=b, residual_dtype=residual_dtype, **kw)
    ref = lambda x, r, s, b: add_rms_norm_reference(x, r, s, 1e-5, bias=b, **kw)
    (y, h), grads = _grads(fn, (x, res, scale, bias), (dy, dh))
    (y64, h64), grads64 = _oracle(ref, (x, res, scale, bias), (dy, dh))
    assert h.dtype == h_dtype and y.dtype == jnp.promote_types(h_dtype, jnp.float32)
    assert [g.dtype for g in grads] == [x.dtype, res.dtype, scale.dtype, bias.dtype]
    low = (
        jnp.float32
        if {jnp.dtype(x_dtype), jnp.dtype(r_dtype)} == {jnp.dtype(jnp.float32)}
        else x_dtype
    )
    _compare((y, h, *grads), (y64, h64, *grads64), low)


def test_add_check_grads(x64):
    ks = jax.random.split(jax.random.key(1), 4)
    x, r = _normal(ks[0], (4, 6), jnp.float64), _normal(ks[1], (4, 6), jnp.float64)
    s, b = _normal(ks[2], (6,), jnp.float64, 0.2, 1.0), _normal(ks[3], (6,), jnp.float64, 0.1)
    f = lambda x, r, s, b: add_rms_norm(x, r, s, 1e-3, bias=b, p=0.5)
    check_grads(f, (x, r, s, b), 2, modes=["rev"])


def test_add_keeps_h_and_a_float_per_row():
    x = jnp.ones((64, 128), jnp.bfloat16)
    r = jnp.ones((64, 128), jnp.float32)
    s = jnp.ones((128,), jnp.float32)
    _, vjp = jax.vjp(lambda x, r, s: add_rms_norm(x, r, s), x, r, s)
    kept = sum(leaf.nbytes for leaf in jax.tree.leaves(vjp))
    assert kept == 64 * 128 * 4 + s.nbytes + 64 * 4  # h (float32), scale, r per row


# ---------------------------------------------------------------- gated_rms_norm


GATED_CASES = [
    dict(),
    dict(activation="sigmoid"),
    dict(norm_before_gate=False),
    dict(norm_before_gate=False, activation="sigmoid", eps_placement="outside"),
    dict(group_size=4),
    dict(group_size=8, norm_before_gate=False),
    dict(p=0.5, scale_offset=1.0),
    dict(shape=(1, 7, 16)),  # a batch of one
    dict(shape=(1, 1, 16), norm_before_gate=False, group_size=8),
]


@pytest.mark.parametrize("kw", GATED_CASES)
@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gated_against_float64_oracle(kw, use_bias, dtype):
    ks = jax.random.split(jax.random.key(2), 5)
    kw = dict(kw)
    shape = kw.pop("shape", (3, 7, 16))
    x, z = _normal(ks[0], shape, dtype, 2.0, 0.3), _normal(ks[1], shape, dtype, 2.0)
    scale = _normal(ks[2], (16,), jnp.float32, 0.3, 1.0)
    bias = _normal(ks[3], (16,), jnp.float32, 0.1) if use_bias else None
    dy = _normal(ks[4], shape, jnp.float32)
    fn = lambda x, z, s, b: gated_rms_norm(x, z, s, 1e-5, bias=b, dtype=jnp.float32, **kw)
    ref = lambda x, z, s, b: gated_rms_norm_reference(x, z, s, 1e-5, bias=b, **kw)
    args = (x, z, scale, bias) if use_bias else (x, z, scale)
    if not use_bias:
        fn_, ref_ = (lambda x, z, s: fn(x, z, s, None)), (lambda x, z, s: ref(x, z, s, None))
    else:
        fn_, ref_ = fn, ref
    y, grads = _grads(fn_, args, (dy,))
    y64, grads64 = _oracle(ref_, args, (dy,))
    assert [g.dtype for g in grads] == [a.dtype for a in args]
    _compare((y, *grads), (y64, *grads64), dtype)


@pytest.mark.parametrize("kw", [dict(), dict(norm_before_gate=False, group_size=3)])
def test_gated_check_grads(x64, kw):
    ks = jax.random.split(jax.random.key(3), 4)
    x, z = _normal(ks[0], (4, 6), jnp.float64), _normal(ks[1], (4, 6), jnp.float64)
    s, b = _normal(ks[2], (6,), jnp.float64, 0.2, 1.0), _normal(ks[3], (6,), jnp.float64, 0.1)
    f = lambda x, z, s, b: gated_rms_norm(x, z, s, 1e-3, bias=b, **kw)
    check_grads(f, (x, z, s, b), 2, modes=["rev"])


def test_gated_by_hand():
    # Groups of two: RMS [3, 4] = sqrt(12.5), RMS [6, 8] = sqrt(50); sigmoid(0) = 1/2.
    x = jnp.array([3.0, 4.0, 6.0, 8.0])
    y = gated_rms_norm(x, jnp.zeros(4), eps=0.0, activation="sigmoid", group_size=2)
    expected = np.array([3, 4, 6, 8]) / np.sqrt([12.5, 12.5, 50, 50]) / 2
    np.testing.assert_allclose(y, expected, rtol=1e-6)
    # Gate first: v = x * silu(2) is a re-scaling of x, which the norm removes.
    y = gated_rms_norm(x, jnp.full(4, 2.0), eps=0.0, norm_before_gate=False)
    np.testing.assert_allclose(y, x / np.sqrt(np.mean(np.square(x))), rtol=1e-6)


@pytest.mark.parametrize("group_size, per_row", [(None, 1), (32, 4)])
def test_gated_keeps_x_gate_and_a_float_per_group(group_size, per_row):
    x = jnp.ones((64, 128), jnp.bfloat16)
    s = jnp.ones((128,), jnp.float32)
    fn = lambda x, z, s: gated_rms_norm(x, z, s, group_size=group_size)
    _, vjp = jax.vjp(fn, x, x, s)
    kept = sum(leaf.nbytes for leaf in jax.tree.leaves(vjp))
    assert kept == 2 * x.nbytes + s.nbytes + 64 * per_row * 4


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda x: add_rms_norm(x, x[:, :4]), ValueError, r"residual with shape \(2, 4\)"),
        (lambda x: add_rms_norm(x, x, residual_dtype=jnp.int32), TypeError, "dtype must be"),
        (lambda x: gated_rms_norm(x, x[:1]), ValueError, r"gate with shape \(1, 8\)"),
        (lambda x: gated_rms_norm(x, x.astype(jnp.int32)), TypeError, "gate must be a real"),
        (lambda x: gated_rms_norm(x, x, activation="relu"), ValueError, "activation must be"),
        (lambda x: gated_rms_norm(x, x, group_size=3), ValueError, "group_size=3 does not"),
        (lambda x: gated_rms_norm(x, x, group_size=0), TypeError, "positive int"),
        (lambda x: gated_rms_norm(x, x, group_size=4, p=0.5), ValueError, "group_size with p"),
        (lambda x: gated_rms_norm(x, x, group_size=4, axis=(0, 1)), ValueError, "axis=\\(0, 1\\)"),
        (lambda x: gated_rms_norm(x, x, norm_before_gate=1), TypeError, "must be a bool"),
    ],
)
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call(jnp.ones((2, 8)))


# ---------------------------------------------------------------- remat policies


def _saved_shapes(fn, policy, *args):
    checkpointed = jax.checkpoint(fn, policy=policy)
    _, vjp = jax.vjp(checkpointed, *args)
    return sorted(leaf.shape for leaf in jax.tree.leaves(vjp))


FUNCTIONS = {
    "rms_norm": lambda x, w: jnp.tanh(rms_norm(x) @ w),
    "add_rms_norm": lambda x, w: jnp.tanh(add_rms_norm(x, 2 * x)[0] @ w),
    "gated_rms_norm": lambda x, w: jnp.tanh(gated_rms_norm(x, x + 1) @ w),
}


@pytest.mark.parametrize("name", FUNCTIONS)
def test_remat_policies_by_name(name):
    x, w = jnp.ones((16, 64)), jnp.ones((64, 8))
    names = jax.checkpoint_policies.save_only_these_names
    shapes = lambda policy: _saved_shapes(FUNCTIONS[name], policy, x, w)
    inputs = sorted([x.shape, w.shape])
    # Nothing named saved: only the inputs; the statistic alone: plus one float per
    # row; the output: plus y (what the matmul's backward needs), no statistic.
    assert shapes(jax.checkpoint_policies.nothing_saveable) == inputs
    assert shapes(names("rms_norm_stat")) == sorted([*inputs, (16, 1)])
    assert shapes(names("rms_norm_out")) == sorted([*inputs, (16, 64)])


def test_add_with_features_split_over_a_mesh_axis():
    """shard_map, the features split over "model" (axis_name), the stream over "data"."""
    with multi_device_mesh((4, 2), ("data", "model")) as mesh:
        ks = jax.random.split(jax.random.key(5), 5)
        x, r = _normal(ks[0], (8, 32), jnp.float32, 2.0), _normal(ks[1], (8, 32), jnp.float32)
        s, dy, dh = (
            _normal(ks[2], (32,), jnp.float32, 0.2, 1.0),
            _normal(ks[3], (8, 32), jnp.float32),
            _normal(ks[4], (8, 32), jnp.float32),
        )
        spec = jax.P("data", "model")
        mapped = jax.shard_map(
            lambda x, r, s: add_rms_norm(x, r, s, axis_name="model"),
            mesh=mesh,
            in_specs=(spec, spec, jax.P("model")),
            out_specs=(spec, spec),
        )
        got = _grads(mapped, (x, r, s), (dy, dh))
        want = _grads(lambda x, r, s: add_rms_norm(x, r, s), (x, r, s), (dy, dh))
        _compare(got, want, jnp.float32)


def test_gated_groups_keep_a_scale_that_broadcasts_over_features(x64):
    """A (rows, 1) scale stays per row when the last axis is split into groups."""
    ks = jax.random.split(jax.random.key(6), 3)
    x, z = _normal(ks[0], (4, 16), jnp.float64), _normal(ks[1], (4, 16), jnp.float64)
    scale = _normal(ks[2], (4, 1), jnp.float64, 0.3, 1.0)
    y = gated_rms_norm(x, z, scale, 1e-5, group_size=4)
    expected = gated_rms_norm_reference(x, z, scale, 1e-5, group_size=4)
    assert_close(y, expected, **tol(jnp.float64))
