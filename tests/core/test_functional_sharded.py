"""rms_norm with the feature axis split across devices (shard_map, axis_name) and sharded jit.

A ("data", "model") = (4, 2) mesh of eight devices: the default backend's, or beside a
single accelerator the eight host CPU devices of conftest.py (helpers.multi_device_mesh).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, devices_for, multi_device_mesh, oracle_value_and_grads, tol
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rmsnorm_jax import rms_norm

pytestmark = pytest.mark.newest


@pytest.fixture
def mesh():
    with multi_device_mesh((4, 2), ("data", "model")) as mesh:
        yield mesh


def _data(shape=(8, 32), seed=0):
    kx, ks, kb, kc = jax.random.split(jax.random.key(seed), 4)
    x = 2 * jax.random.normal(kx, shape, jnp.float32) + 0.3
    scale = 1 + 0.3 * jax.random.normal(ks, shape[-1:], jnp.float32)
    bias = 0.1 * jax.random.normal(kb, shape[-1:], jnp.float32)
    ct = jax.random.normal(kc, shape, jnp.float32)
    return x, scale, bias, ct


def _sharded_value_and_grads(fn, mesh, specs, x, scale, bias, ct):
    x_spec, param_spec = specs
    mapped = jax.shard_map(
        fn, mesh=mesh, in_specs=(x_spec, param_spec, param_spec), out_specs=x_spec
    )

    def loss(x, scale, bias):
        return jnp.sum(mapped(x, scale, bias) * ct)

    y = jax.jit(mapped)(x, scale, bias)
    return y, jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, scale, bias)


@pytest.mark.parametrize("p", [1.0, 0.25, 0.3, 0.7])
@pytest.mark.parametrize("placement", ["inside", "outside"])
def test_features_split_over_model_axis(x64, mesh, p, placement):
    """x split over batch ("data") and features ("model"); scale and bias over "model".

    The parameters are replicated over "data", so their gradients must come back
    summed over it; with p < 1 the first k features are counted globally.
    """
    x, scale, bias, ct = _data()
    kw = dict(eps=1e-5, p=p, eps_placement=placement)

    def fn(x, scale, bias):
        return rms_norm(x, scale, bias=bias, axis_name="model", **kw)

    y, grads = _sharded_value_and_grads(
        fn, mesh, (P("data", "model"), P("model")), x, scale, bias, ct
    )
    y64, grads64 = oracle_value_and_grads(x, scale, bias, ct, **kw)
    assert_close(y, y64, **tol(jnp.float32))
    for g, g64 in zip(grads, grads64, strict=True):
        assert_close(g, g64, **tol(jnp.float32))


def test_replicated_scale_gradient_is_summed_over_data(x64, mesh):
    """Features whole on each device, batch split over both mesh axes, parameters
    replicated everywhere: the backward rule must psum their cotangents."""
    x, scale, bias, ct = _data((16, 8), seed=1)

    def fn(x, scale, bias):
        return rms_norm(x, scale, 1e-6, bias=bias, p=0.5)

    y, grads = _sharded_value_and_grads(fn, mesh, (P(("data", "model")), P()), x, scale, bias, ct)
    y64, grads64 = oracle_value_and_grads(x, scale, bias, ct, eps=1e-6, p=0.5)
    assert_close(y, y64, **tol(jnp.float32))
    for g, g64 in zip(grads, grads64, strict=True):
        assert_close(g, g64, **tol(jnp.float32))


def test_features_split_over_two_mesh_axes(x64, mesh):
    x, scale, bias, ct = _data((4, 64), seed=2)

    def fn(x, scale, bias):
        return rms_norm(x, scale, bias=bias, axis_name=("data", "model"), p=0.1)

    y, grads = _sharded_value_and_grads(
        fn, mesh, (P(None, ("data", "model")), P(("data", "model"))), x, scale, bias, ct
    )
    y64, grads64 = oracle_value_and_grads(x, scale, bias, ct, eps=1e-6, p=0.1)
    assert_close(y, y64, **tol(jnp.float32))
    for g, g64 in zip(grads, grads64, strict=True):
        assert_close(g, g64, **tol(jnp.float32))


def test_sharded_jit_matches_single_device(mesh):
    x, scale, bias, ct = _data((16, 64), seed=3)
    place = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))

    def loss(x, scale, bias):
        return jnp.sum(rms_norm(x, scale, bias=bias, p=0.25) * ct)

    grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    expected = grad_fn(x, scale, bias)
    got = grad_fn(place(x, P("data", "model")), place(scale, P("model")), place(bias, P()))
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)


def test_partial_with_split_features_needs_one_axis(mesh):
    def fn(x):
        return rms_norm(x, axis=(0, 1), axis_name="model", p=0.5)

    mapped = jax.shard_map(fn, mesh=mesh, in_specs=P(None, "model"), out_specs=P(None, "model"))
    with pytest.raises(ValueError, match="needs exactly one normalized axis"):
        jax.jit(mapped)(jnp.ones((4, 8)))


@pytest.mark.parametrize("p", [1.0, 0.25])
def test_explicit_sharding_mesh(p):
    """jax.make_mesh's default (Explicit axes): sharded contractions need an out_sharding."""
    with multi_device_mesh((4, 2), ("data", "model"), "explicit") as mesh:
        assert set(mesh.axis_types) == {jax.sharding.AxisType.Explicit}
        x, scale, bias, ct = _data((16, 64), seed=4)

        def value_and_grads(x, scale, bias):
            def loss(x, scale, bias):
                return jnp.sum(rms_norm(x, scale, bias=bias, p=p) * ct)

            return jax.value_and_grad(loss, argnums=(0, 1, 2))(x, scale, bias)

        expected = jax.jit(value_and_grads)(x, scale, bias)
        place = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
        with jax.set_mesh(mesh):
            y = jax.jit(lambda x, s: rms_norm(x, s, p=p))(
                place(x, P("data", "model")), place(scale, P("model"))
            )
            got = jax.jit(value_and_grads)(
                place(x, P("data", "model")), place(scale, P("model")), place(bias, P())
            )
        assert y.sharding.spec == P("data", "model")
        np.testing.assert_allclose(y, rms_norm(x, scale, p=p), rtol=1e-6, atol=1e-6)
        for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("p", [1.0, 0.25])
def test_pmap_with_features_split(p):
    """pmap over 4 devices, each holding a quarter of the features; gradient of the
    global loss taken per device (the backward's psum joins the cross terms)."""
    devices = devices_for(4)
    with jax.default_device(devices[0]):
        x, scale, _, _ = _data((3, 16), seed=5)
        joined = lambda a: a.swapaxes(0, 1).reshape(3, 16)
        xs, ss = x.reshape(3, 4, 4).swapaxes(0, 1), scale.reshape(4, 4)  # device axis first

        def loss(norm):
            return lambda x, s: jnp.sum(jnp.sin(norm(x, s)))

        sharded = lambda x, s: rms_norm(x, s, p=p, axis_name="d")
        y = jax.pmap(sharded, axis_name="d", devices=devices)(xs, ss)
        dx, ds = jax.pmap(jax.grad(loss(sharded), (0, 1)), axis_name="d", devices=devices)(xs, ss)
        single = lambda x, s: rms_norm(x, s, p=p)
        dx_ref, ds_ref = jax.grad(loss(single), (0, 1))(x, scale)
        np.testing.assert_allclose(joined(y), single(x, scale), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(joined(dx), dx_ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(ds.reshape(16), ds_ref, rtol=1e-5, atol=1e-5)
