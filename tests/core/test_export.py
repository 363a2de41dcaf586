"""``jax.export`` with a symbolic batch (a model exported for serving or for training at
any batch size): every function under every implementation exports its value and its
gradient, and the exported program, called at a concrete batch, is the float64 formula.
The kernels size their grids by the row count, so with symbolic rows every path is XLA's,
and ``explain`` says why."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from rmsnorm_jax import add_rms_norm, gated_rms_norm, rms_norm
from rmsnorm_jax.kernels import explain
from rmsnorm_jax.reference import (
    add_rms_norm_reference,
    gated_rms_norm_reference,
    rms_norm_reference,
)

pytestmark = pytest.mark.newest

N = 128
OPS = {
    "rms_norm": (lambda x, s, **kw: rms_norm(x, s, **kw), rms_norm_reference),
    "add_rms_norm": (
        lambda x, s, **kw: add_rms_norm(x, jnp.sin(x), s, **kw)[0],
        lambda x, s: add_rms_norm_reference(x, jnp.sin(x), s)[0],
    ),
    "gated_rms_norm": (
        lambda x, s, **kw: gated_rms_norm(x, jnp.cos(x), s, **kw),
        lambda x, s: gated_rms_norm_reference(x, jnp.cos(x), s),
    ),
}


def _loss(fn):
    return lambda x, s: jnp.sum(jnp.sin(fn(x, s)))


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("implementation", ["auto", "xla", "pallas", "triton"])
def test_export_with_a_symbolic_batch(op, implementation):
    ours, oracle = OPS[op]
    (b,) = export.symbolic_shape("b")
    x_type = jax.ShapeDtypeStruct((b, 3, N), jnp.float32)
    s_type = jax.ShapeDtypeStruct((N,), jnp.float32)
    fn = lambda x, s: ours(x, s, implementation=implementation)
    grads = export.export(jax.jit(jax.value_and_grad(_loss(fn), (0, 1))))(x_type, s_type)
    x = jax.random.normal(jax.random.key(0), (5, 3, N), jnp.float32)
    s = 1 + 0.1 * jax.random.normal(jax.random.key(1), (N,), jnp.float32)
    got = grads.call(x, s)
    with jax.enable_x64(True):
        x64, s64 = (jnp.asarray(np.asarray(a, np.float64)) for a in (x, s))
        want = jax.value_and_grad(_loss(oracle), (0, 1))(x64, s64)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        w = np.asarray(w)
        np.testing.assert_allclose(
            np.asarray(g, np.float64), w, rtol=2e-5, atol=2e-5 * np.abs(w).max()
        )
    if op == "rms_norm" and implementation != "xla":
        assert "rows, not a number" in explain(rms_norm, x_type, implementation=implementation)
