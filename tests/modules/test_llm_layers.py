"""The Modules' residual and gated forms, and QK-norm as LLMs use it (Qwen3 and Gemma 3
per head, OLMo 2 over all heads with the heads split across a ``model`` mesh axis)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_close, multi_device_mesh, to64, tol
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import rmsnorm_jax
import rmsnorm_jax.nnx
from rmsnorm_jax import add_rms_norm, gated_rms_norm
from rmsnorm_jax.reference import rms_norm_reference

pytestmark = pytest.mark.newest


def _normal(seed, shape, scale=1.0, shift=0.0):
    return scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32) + shift


# ---------------------------------------------------------------- the Modules' forms


def test_linen_residual_and_gate_forms_share_the_parameters():
    x, r, z = _normal(0, (2, 5, 16)), _normal(1, (2, 5, 16)), _normal(2, (2, 5, 16))
    layer = rmsnorm_jax.RMSNorm(epsilon=1e-5, group_size=4, norm_before_gate=False)
    plain = rmsnorm_jax.RMSNorm(epsilon=1e-5)
    variables = plain.init(jax.random.key(0), x)
    variables = jax.tree.map(lambda a: a + 0.1 * jnp.arange(a.size).reshape(a.shape), variables)
    assert jax.tree.structure(layer.init(jax.random.key(0), x, gate=z)) == jax.tree.structure(
        variables
    )
    scale = variables["params"]["scale"]
    y, h = plain.apply(variables, x, residual=r)
    y_ref, h_ref = add_rms_norm(x, r, scale, 1e-5)
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(h, h_ref)
    np.testing.assert_array_equal(
        layer.apply(variables, x, gate=z),
        gated_rms_norm(x, z, scale, 1e-5, group_size=4, norm_before_gate=False),
    )


def test_nnx_residual_and_gate_forms():
    x, r, z = _normal(0, (2, 5, 16)), _normal(1, (2, 5, 16)), _normal(2, (2, 5, 16))
    layer = rmsnorm_jax.nnx.RMSNorm(16, activation="sigmoid", rngs=nnx.Rngs(0))
    scale = layer.scale[...]
    y, h = layer(x, residual=r)
    np.testing.assert_array_equal(y, add_rms_norm(x, r, scale)[0])
    np.testing.assert_array_equal(h, x + r)
    np.testing.assert_array_equal(
        layer(x, gate=z), gated_rms_norm(x, z, scale, activation="sigmoid")
    )


@pytest.mark.parametrize(
    "kwargs, call, match",
    [
        ({}, dict(residual=1, gate=1), "residual= or gate=, not both"),
        (dict(group_size=4), {}, "group_size=4 applies to the gated form"),
        (dict(activation="tanh"), dict(gate=1), "activation must be"),
    ],
)
def test_module_form_errors(kwargs, call, match):
    x = jnp.ones((2, 8))
    call = {k: x for k in call}
    with pytest.raises(ValueError, match=match):
        rmsnorm_jax.RMSNorm(**kwargs).init(jax.random.key(0), x, **call)


# ---------------------------------------------------------------- QK-norm


@pytest.mark.parametrize("scale_shape", [(64,), (4, 64)])
def test_qk_norm_per_head(x64, scale_shape):
    """Queries (batch, seq, heads, head_dim) normalized over head_dim: a (head_dim,)
    scale (Qwen3, Gemma 3) or one per head, (heads, head_dim)."""
    q = _normal(0, (2, 8, 4, 64), 3.0)
    feature_axes = -1 if len(scale_shape) == 1 else (-2, -1)
    layer = rmsnorm_jax.RMSNorm(epsilon=1e-6, reduction_axes=-1, feature_axes=feature_axes)
    variables = layer.init(jax.random.key(0), q)
    assert variables["params"]["scale"].shape == scale_shape
    scale = 1 + _normal(1, scale_shape, 0.2)
    y = layer.apply({"params": {"scale": scale}}, q)
    with jax.enable_x64(True):
        expected = rms_norm_reference(*to64((q, scale)), 1e-6, axis=-1)
    assert_close(y, expected, **tol(jnp.float32))


def _olmo_norm(q, scale, **kw):
    return rmsnorm_jax.rms_norm(q, scale, 1e-6, axis=(-2, -1), **kw)


def _value_and_grads(fn, q, scale, ct):
    loss = lambda q, s: jnp.sum(fn(q, s) * ct)
    return fn(q, scale), jax.grad(loss, (0, 1))(q, scale)


@pytest.fixture
def mesh():
    with multi_device_mesh((4, 2), ("data", "model")) as mesh:
        yield mesh


def test_qk_norm_over_all_heads_sharded_jit(mesh):
    """OLMo 2: one statistic over heads x head_dim, the heads split across "model"."""
    q, ct = _normal(0, (8, 16, 4, 32), 2.0), _normal(2, (8, 16, 4, 32))
    scale = 1 + _normal(1, (4, 32), 0.2)
    want = _value_and_grads(_olmo_norm, q, scale, ct)
    spec = NamedSharding(mesh, P("data", None, "model", None))
    args = (
        jax.device_put(q, spec),
        jax.device_put(scale, NamedSharding(mesh, P("model", None))),
        jax.device_put(ct, spec),
    )
    got = jax.jit(lambda q, s, c: _value_and_grads(_olmo_norm, q, s, c))(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_close(a, b, **tol(jnp.float32))


def test_qk_norm_over_all_heads_shard_map(mesh):
    q, ct = _normal(0, (8, 16, 4, 32), 2.0), _normal(2, (8, 16, 4, 32))
    scale = 1 + _normal(1, (4, 32), 0.2)
    want = _value_and_grads(_olmo_norm, q, scale, ct)
    x_spec, s_spec = P("data", None, "model", None), P("model", None)
    mapped = jax.shard_map(
        lambda q, s: _olmo_norm(q, s, axis_name="model"),
        mesh=mesh,
        in_specs=(x_spec, s_spec),
        out_specs=x_spec,
    )
    got = jax.jit(lambda q, s, c: _value_and_grads(mapped, q, s, c))(q, scale, ct)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_close(a, b, **tol(jnp.float32))
