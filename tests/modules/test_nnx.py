"""rmsnorm_jax.nnx.RMSNorm: mirrors flax.nnx.RMSNorm, equals the linen Module, nnx.jit/scan."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_close, offset_normal, tol

import rmsnorm_jax
import rmsnorm_jax.nnx

pytestmark = [pytest.mark.newest, pytest.mark.oldest]


def _x(shape=(4, 3, 16), dtype=jnp.float32, seed=0):
    return offset_normal(shape, dtype, seed)


def _randomize(module, seed=1):
    params = nnx.state(module, nnx.Param)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = [
        (1 + 0.3 * jax.random.normal(k, a.shape, jnp.float32)).astype(a.dtype)
        for k, a in zip(keys, leaves, strict=True)
    ]
    nnx.update(module, jax.tree.unflatten(treedef, new))


@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kw", [dict(), dict(reduction_axes=(1, 2)), dict(dtype=jnp.bfloat16)])
def test_mirrors_flax_nnx(x_dtype, kw):
    ours = rmsnorm_jax.nnx.RMSNorm(16, epsilon=1e-5, rngs=nnx.Rngs(0), **kw)
    theirs = nnx.RMSNorm(16, epsilon=1e-5, rngs=nnx.Rngs(0), **kw)
    shapes = lambda m: jax.tree.map(lambda a: (a.shape, a.dtype), nnx.state(m, nnx.Param))
    assert shapes(ours) == shapes(theirs)
    _randomize(theirs)
    nnx.update(ours, nnx.state(theirs, nnx.Param))
    x = _x(dtype=x_dtype)
    y_ours, y_theirs = ours(x), theirs(x)
    assert y_ours.dtype == y_theirs.dtype
    low = x_dtype == jnp.bfloat16 or kw.get("dtype") == jnp.bfloat16
    assert_close(y_ours, y_theirs, **tol(jnp.bfloat16 if low else jnp.float32))


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(p=0.25, use_bias=True, scale_offset=1.0, eps_placement="outside"),
        dict(reduction_axes=(1, 2), feature_axes=-1, p=0.5),
    ],
)
def test_equals_linen_outputs_and_gradients(kw):
    x = _x()
    linen_layer = rmsnorm_jax.RMSNorm(epsilon=1e-5, **kw)
    variables = linen_layer.init(jax.random.key(0), x)
    variables = jax.tree.map(lambda a: a + 0.1 * jnp.arange(a.size).reshape(a.shape), variables)
    layer = rmsnorm_jax.nnx.RMSNorm(16, epsilon=1e-5, rngs=nnx.Rngs(0), **kw)
    nnx.update(layer, variables["params"])

    ct = jax.random.normal(jax.random.key(3), x.shape)
    np.testing.assert_array_equal(layer(x), linen_layer.apply(variables, x))

    def nnx_loss(model, x):
        return jnp.sum(model(x) * ct)

    grads_nnx, gx_nnx = nnx.grad(nnx_loss, argnums=(0, 1))(layer, x)
    grads_linen, gx_linen = jax.grad(
        lambda v, x: jnp.sum(linen_layer.apply(v, x) * ct), argnums=(0, 1)
    )(variables, x)
    np.testing.assert_array_equal(gx_nnx, gx_linen)
    for name, g in grads_linen["params"].items():
        np.testing.assert_array_equal(grads_nnx[name][...], g)


def test_nnx_jit_and_scan():
    class Stack(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=3)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return rmsnorm_jax.nnx.RMSNorm(16, p=0.5, rngs=rngs)

            self.norms = make(rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def step(h, norm):
                return h + norm(h)

            return step(x, self.norms)

    model = Stack(nnx.Rngs(0))
    assert model.norms.scale.shape == (3, 16)
    x = _x((4, 16))

    @nnx.jit
    def loss_and_grad(model, x):
        return nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2))(model)

    loss, grads = loss_and_grad(model, x)
    from rmsnorm_jax.reference import rms_norm_reference

    def unrolled(scales):
        h = x
        for i in range(3):
            h = h + rms_norm_reference(h, scales[i], 1e-6, p=0.5)
        return jnp.sum(h**2)

    scales = model.norms.scale[...]
    np.testing.assert_allclose(loss, unrolled(scales), rtol=1e-5)
    np.testing.assert_allclose(
        grads.norms.scale[...], jax.grad(unrolled)(scales), rtol=1e-4, atol=1e-5
    )


def test_wrong_feature_count_raises():
    layer = rmsnorm_jax.nnx.RMSNorm(8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_features=8"):
        layer(jnp.ones((2, 16)))


def test_axis_index_groups_raises():
    with pytest.raises(ValueError, match="axis_index_groups"):
        rmsnorm_jax.nnx.RMSNorm(8, axis_index_groups=[[0]], rngs=nnx.Rngs(0))


def test_linen_and_nnx_default_init_agree():
    x = _x((2, 16))
    v = nn.RMSNorm().init(jax.random.key(0), x)
    layer = rmsnorm_jax.nnx.RMSNorm(16, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(layer.scale[...], v["params"]["scale"])
