"""The linen Module on a ("data", "model") mesh of 8 devices: sharded jit and shard_map.

The default backend's devices, or beside a single accelerator the eight host CPU devices
of conftest.py (helpers.multi_device_mesh).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import multi_device_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import rmsnorm_jax

pytestmark = pytest.mark.newest

RULES = (("batch", "data"), ("embed", "model"))


@pytest.fixture
def mesh():
    with multi_device_mesh((4, 2), ("data", "model")) as mesh:
        yield mesh


def _setup(p):
    layer = rmsnorm_jax.RMSNorm(p=p, use_bias=True, logical_axes=("embed",), epsilon=1e-5)
    x = 2 * jax.random.normal(jax.random.key(0), (16, 64), jnp.float32) + 0.3
    ct = jax.random.normal(jax.random.key(1), x.shape, jnp.float32)
    boxed = layer.init(jax.random.key(2), x)
    variables = jax.tree.map(lambda a: a + 0.05 * jnp.arange(64.0), nn.meta.unbox(boxed))
    return layer, x, ct, boxed, variables


def _value_and_grads(apply, variables, x, ct):
    def loss(v, x):
        return jnp.sum(apply(v, x) * ct)

    return apply(variables, x), jax.grad(loss, argnums=(0, 1))(variables, x)


def _assert_trees_close(a, b):
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-6, atol=1e-6), a, b)


@pytest.mark.parametrize("p", [1.0, 0.25])
def test_sharded_jit_equals_single_device(mesh, p):
    layer, x, ct, boxed, variables = _setup(p)
    expected = jax.jit(lambda v, x: _value_and_grads(layer.apply, v, x, ct))(variables, x)

    param_shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, RULES)
    assert param_shardings["params"]["scale"].spec == P("model")
    x_sharding = NamedSharding(mesh, nn.logical_to_mesh_axes(("batch", "embed"), RULES))
    assert x_sharding.spec == P("data", "model")
    sharded_vars = jax.device_put(variables, param_shardings)
    sharded_x = jax.device_put(x, x_sharding)

    fn = jax.jit(
        lambda v, x: _value_and_grads(layer.apply, v, x, ct),
        out_shardings=(x_sharding, (param_shardings, x_sharding)),
    )
    got = fn(sharded_vars, sharded_x)
    assert got[0].sharding.spec == P("data", "model")
    _assert_trees_close(got, expected)


@pytest.mark.parametrize("p", [1.0, 0.25])
def test_shard_map_with_axis_name_equals_single_device(mesh, p):
    layer, x, ct, _, variables = _setup(p)
    expected = jax.jit(lambda v, x: _value_and_grads(layer.apply, v, x, ct))(variables, x)

    split = rmsnorm_jax.RMSNorm(p=p, use_bias=True, epsilon=1e-5, axis_name="model")
    param_specs = jax.tree.map(lambda _: P("model"), variables)
    apply = jax.shard_map(
        split.apply,
        mesh=mesh,
        in_specs=(param_specs, P("data", "model")),
        out_specs=P("data", "model"),
    )
    got = jax.jit(lambda v, x: _value_and_grads(apply, v, x, ct))(variables, x)
    _assert_trees_close(got, expected)
