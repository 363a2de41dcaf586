"""Small shared helpers for the tests: the float64 oracle and tolerances per dtype."""

import jax
import jax.numpy as jnp
import numpy as np

from rmsnorm_jax.reference import rms_norm_reference

# Tolerances for comparing a result computed from dtype-d inputs with the float64
# oracle on the same input values: the output is rounded once to the dtype, and for
# low precision the scale and dy rounding add a few ulps.
TOL = {
    jnp.dtype(jnp.float64): dict(rtol=1e-12, atol=1e-12),
    jnp.dtype(jnp.float32): dict(rtol=2e-5, atol=2e-5),
    jnp.dtype(jnp.bfloat16): dict(rtol=2e-2, atol=2e-2),
    jnp.dtype(jnp.float16): dict(rtol=2e-3, atol=2e-3),
}


def tol(dtype):
    return TOL[jnp.dtype(dtype)]


def to64(tree):
    return jax.tree.map(lambda a: None if a is None else jnp.asarray(a, jnp.float64), tree)


def oracle_value_and_grads(x, scale, bias, ct, **kw):
    """Float64 y and (dx, dscale, dbias) of sum(y * ct) from the plain formula.

    Must run under ``jax.enable_x64(True)``.
    """
    x, scale, bias, ct = to64((x, scale, bias, ct))

    def loss(x, scale, bias):
        return jnp.sum(rms_norm_reference(x, scale, bias=bias, **kw) * ct)

    y = rms_norm_reference(x, scale, bias=bias, **kw)
    return y, jax.grad(loss, argnums=(0, 1, 2))(x, scale, bias)


def assert_close(actual, expected, rtol, atol):
    """Compares in float64; ``atol`` is relative to the largest magnitude expected.

    Sums such as the scale gradient grow with the number of rows, so an absolute
    tolerance has to be measured against the size of the result.
    """
    if expected is None:
        assert actual is None
        return
    expected = np.asarray(expected, np.float64)
    magnitude = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
    np.testing.assert_allclose(
        np.asarray(actual, np.float64), expected, rtol=rtol, atol=atol * magnitude
    )
