"""rmsnorm_jax.RMSNorm as a drop-in for flax.linen.RMSNorm, and its additions vs the oracle."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, offset_normal, oracle_value_and_grads, tol

import rmsnorm_jax

pytestmark = [pytest.mark.newest, pytest.mark.oldest]

# Configurations flax supports: the feature axes are the reduced ones or a subset.
AXES = [
    dict(),
    dict(reduction_axes=(1, 2)),
    dict(reduction_axes=(1, 2), feature_axes=(1, 2)),
    dict(reduction_axes=(-2, -1), feature_axes=-2),
]


def _x(dtype, shape=(4, 3, 16), seed=0):
    return offset_normal(shape, dtype, seed)


def _random_params(variables, seed=1):
    """Non-trivial parameters so that a scale bug cannot hide behind ones."""
    leaves, treedef = jax.tree.flatten(variables)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(
        treedef,
        [
            (1 + 0.3 * jax.random.normal(k, a.shape, jnp.float32)).astype(a.dtype)
            for k, a in zip(keys, leaves, strict=True)
        ],
    )


def _tol(*dtypes):
    """Tolerance of the coarsest dtype involved."""
    return tol(max((jnp.dtype(d) for d in dtypes), key=lambda d: jnp.finfo(d).eps))


@pytest.mark.parametrize("axes", AXES)
@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
def test_same_params_outputs_and_gradients_as_flax(axes, x_dtype, dtype, param_dtype):
    kw = dict(axes, dtype=dtype, param_dtype=param_dtype, epsilon=1e-5)
    ours, theirs = rmsnorm_jax.RMSNorm(**kw), nn.RMSNorm(**kw)
    x = _x(x_dtype)
    v_ours = ours.init(jax.random.key(0), x)
    v_theirs = theirs.init(jax.random.key(0), x)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), v_ours) == jax.tree.map(
        lambda a: (a.shape, a.dtype), v_theirs
    )
    jax.tree.map(np.testing.assert_array_equal, v_ours, v_theirs)
    variables = _random_params(v_theirs)
    y_ours, y_theirs = ours.apply(variables, x), theirs.apply(variables, x)
    assert y_ours.dtype == y_theirs.dtype
    tolerance = _tol(x_dtype, param_dtype, y_theirs.dtype)
    assert_close(y_ours, y_theirs, **tolerance)

    ct = jax.random.normal(jax.random.key(9), x.shape, jnp.float32)

    def grads(module):
        def loss(v, x):
            return jnp.sum(module.apply(v, x).astype(jnp.float32) * ct)

        return jax.grad(loss, argnums=(0, 1))(variables, x)

    (gv_ours, gx_ours), (gv_theirs, gx_theirs) = grads(ours), grads(theirs)
    assert gx_ours.dtype == gx_theirs.dtype
    assert_close(gx_ours, gx_theirs, **tolerance)
    jax.tree.map(lambda a, b: assert_close(a, b, **tolerance), gv_ours, gv_theirs)


def test_parameters_load_both_ways():
    x = _x(jnp.float32)
    ours, theirs = rmsnorm_jax.RMSNorm(), nn.RMSNorm()
    from_flax = _random_params(theirs.init(jax.random.key(0), x), seed=2)
    from_ours = _random_params(ours.init(jax.random.key(0), x), seed=3)
    for variables in (from_flax, from_ours):
        np.testing.assert_allclose(
            ours.apply(variables, x), theirs.apply(variables, x), rtol=1e-6, atol=1e-6
        )


@pytest.mark.parametrize("p", [1.0, 0.25])
def test_additions_match_the_oracle(x64, p):
    """bias, zero-centred scale, p and the outside placement, against the float64 formula."""
    x = _x(jnp.float32, (4, 32))
    layer = rmsnorm_jax.RMSNorm(
        p=p,
        use_bias=True,
        scale_offset=1.0,
        scale_init=nn.initializers.zeros,
        eps_placement="outside",
        epsilon=1e-4,
    )
    variables = layer.init(jax.random.key(0), x)
    assert jax.tree.map(jnp.shape, variables) == {"params": {"scale": (32,), "bias": (32,)}}
    np.testing.assert_array_equal(variables["params"]["scale"], 0.0)
    variables = jax.tree.map(lambda a: a - 0.1 * jnp.arange(32.0) / 32, variables)
    scale, bias = variables["params"]["scale"], variables["params"]["bias"]
    ct = jax.random.normal(jax.random.key(1), x.shape, jnp.float32)
    kw = dict(eps=1e-4, p=p, scale_offset=1.0, eps_placement="outside")
    y64, (gx64, gs64, gb64) = oracle_value_and_grads(x, scale, bias, ct, **kw)

    def loss(v, x):
        return jnp.sum(layer.apply(v, x) * ct)

    gv, gx = jax.grad(loss, argnums=(0, 1))(variables, x)
    assert_close(layer.apply(variables, x), y64, **tol(jnp.float32))
    assert_close(gx, gx64, **tol(jnp.float32))
    assert_close(gv["params"]["scale"], gs64, **tol(jnp.float32))
    assert_close(gv["params"]["bias"], gb64, **tol(jnp.float32))


class _Stack(nn.Module):
    """Three residual blocks through nn.scan, each normed then projected, under nn.remat."""

    p: float = 1.0

    @nn.compact
    def __call__(self, x):
        class Block(nn.Module):
            p: float

            @nn.compact
            def __call__(self, h, _):
                y = nn.Dense(h.shape[-1], kernel_init=nn.initializers.normal(0.3))(
                    rmsnorm_jax.RMSNorm(p=self.p)(h)
                )
                return h + y, None

        scanned = nn.scan(
            nn.remat(Block),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=3,
        )(p=self.p, name="blocks")
        return scanned(x, None)[0]


def test_inside_scan_remat_and_vmap():
    x = _x(jnp.float32, (4, 16))
    model = _Stack(p=0.5)
    variables = model.init(jax.random.key(0), x)
    assert variables["params"]["blocks"]["RMSNorm_0"]["scale"].shape == (3, 16)

    def loss(v):
        return jnp.sum(model.apply(v, x) ** 2)

    grads = jax.jit(jax.grad(loss))(variables)
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))

    # The same blocks unrolled by hand with the reference formula as the oracle.
    from rmsnorm_jax.reference import rms_norm_reference

    def unrolled(v):
        h = x
        blk = v["params"]["blocks"]
        for i in range(3):
            n = rms_norm_reference(h, blk["RMSNorm_0"]["scale"][i], 1e-6, p=0.5)
            h = h + n @ blk["Dense_0"]["kernel"][i] + blk["Dense_0"]["bias"][i]
        return jnp.sum(h**2)

    np.testing.assert_allclose(loss(variables), unrolled(variables), rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
        grads,
        jax.grad(unrolled)(variables),
    )

    # nn.vmap over a leading axis with per-example parameters.
    vmapped = nn.vmap(
        rmsnorm_jax.RMSNorm,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=0,
    )()
    xs = _x(jnp.float32, (2, 4, 16), seed=5)
    v = _random_params(vmapped.init(jax.random.key(0), xs))
    assert v["params"]["scale"].shape == (2, 16)
    expected = jnp.stack(
        [rms_norm_reference(xs[i], v["params"]["scale"][i], 1e-6) for i in range(2)]
    )
    np.testing.assert_allclose(vmapped.apply(v, xs), expected, rtol=1e-5, atol=1e-6)


def test_logical_axes_box_the_parameters():
    layer = rmsnorm_jax.RMSNorm(use_bias=True, logical_axes=("embed",))
    variables = layer.init(jax.random.key(0), jnp.ones((2, 8)))
    assert nn.get_partition_spec(variables) == {
        "params": {
            "scale": jax.sharding.PartitionSpec("embed"),
            "bias": jax.sharding.PartitionSpec("embed"),
        }
    }
    unboxed = nn.meta.unbox(variables)
    np.testing.assert_array_equal(
        layer.apply(unboxed, jnp.ones((2, 8))), layer.apply(variables, jnp.ones((2, 8)))
    )


@pytest.mark.parametrize(
    "kwargs, call_kwargs, match",
    [
        (dict(axis_index_groups=[[0, 1]]), {}, "axis_index_groups"),
        (dict(force_float32_reductions=False), {}, "force_float32_reductions=False"),
        ({}, dict(mask=jnp.ones((2, 9), bool)), "mask with shape"),
        (dict(p=0.5), dict(mask=jnp.ones((2, 8), bool)), "mask with p=0.5 is ambiguous"),
        (dict(logical_axes=("a", "b")), {}, "logical_axes"),
        (dict(p=0.0), {}, r"p must be in \(0, 1\]"),
        (dict(feature_axes=5), {}, "feature_axes: axis 5 is out of range"),
        (dict(eps_placement="nowhere"), {}, "eps_placement"),
    ],
)
def test_unsupported_or_bad_options_raise(kwargs, call_kwargs, match):
    layer = rmsnorm_jax.RMSNorm(**kwargs)
    with pytest.raises(ValueError, match=match):
        layer.init(jax.random.key(0), jnp.ones((2, 8)), **call_kwargs)


def test_use_fast_variance_makes_no_difference():
    x = _x(jnp.float32)
    v = rmsnorm_jax.RMSNorm().init(jax.random.key(0), x)
    np.testing.assert_array_equal(
        rmsnorm_jax.RMSNorm(use_fast_variance=False).apply(v, x), rmsnorm_jax.RMSNorm().apply(v, x)
    )
