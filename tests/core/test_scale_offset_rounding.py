"""The zero-centred scale rounds as the formula says on every backend and path.

``y = (scale + scale_offset) * x * r``: ``scale + 1`` is exact in float32 for ``scale`` in
[-2, -0.5] (Sterbenz), so wherever ``1 + scale`` is near 0 each output element is its float64
value to a few ulp *of itself*. A form that distributes the offset (``a * scale + a``,
which XLA:GPU once got) cancels there, and its error is a few ulp of ``a = x * r`` instead:
measured up to 49x this bound on an H200 (issue 34). On a CPU this guards the formula; on a
GPU (the device runbook runs this file) it checks what XLA:GPU and the kernels compile.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rmsnorm_jax import add_rms_norm, rms_norm

pytestmark = pytest.mark.newest

F32_EPS = 2.0**-24  # unit roundoff
ULPS = 8  # x * r (rsqrt's few ulp), the product with the gain, the output rounding


def _near_minus_one(n: int, seed: int) -> np.ndarray:
    """A float32 scale with ``1 + scale`` spread over [-2^-6, 2^-6] and some exact zeros."""
    rng = np.random.default_rng(seed)
    scale = -1.0 + rng.uniform(-(2.0**-6), 2.0**-6, n)
    scale[::7] = -1.0
    return scale.astype(np.float32)


def _bound(y64: np.ndarray, dtype) -> np.ndarray:
    rounding = float(jnp.finfo(dtype).eps) / 2 if dtype != jnp.float32 else 0.0
    return (ULPS * F32_EPS + rounding) * np.abs(y64) + 1e-30


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("n", [256, 1000, 4096])
def test_one_plus_scale_near_zero(implementation, dtype, n):
    x = jax.random.normal(jax.random.key(n), (16, n), jnp.float32).astype(dtype)
    scale = _near_minus_one(n, n)
    eps = 1e-6
    y = jax.jit(lambda x, s: rms_norm(x, s, eps, scale_offset=1.0, implementation=implementation))(
        x, jnp.asarray(scale)
    )
    x64 = np.asarray(x, np.float64)
    r64 = 1 / np.sqrt(np.mean(x64**2, axis=-1, keepdims=True) + eps)
    y64 = (scale.astype(np.float64) + 1.0) * x64 * r64
    err = np.abs(np.asarray(y, np.float64) - y64)
    worst = float(np.max(err / _bound(y64, dtype)))
    assert worst <= 1.0, (
        f"{implementation} y off by {worst:.2f}x the rounding bound where 1 + scale is near 0 "
        f"on {jax.devices()[0].platform}"
    )


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_fused_add_one_plus_scale_near_zero(implementation):
    n = 2048
    x = jax.random.normal(jax.random.key(1), (8, n), jnp.float32)
    res = jax.random.normal(jax.random.key(2), (8, n), jnp.float32)
    scale = _near_minus_one(n, 3)
    y, h = jax.jit(
        lambda x, r, s: add_rms_norm(x, r, s, 1e-6, scale_offset=1.0, implementation=implementation)
    )(x, res, jnp.asarray(scale))
    h64 = np.asarray(h, np.float64)  # the h the norm read (rounded to float32 once)
    r64 = 1 / np.sqrt(np.mean(h64**2, axis=-1, keepdims=True) + 1e-6)
    y64 = (scale.astype(np.float64) + 1.0) * h64 * r64
    err = np.abs(np.asarray(y, np.float64) - y64)
    assert float(np.max(err / _bound(y64, jnp.float32))) <= 1.0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_h100_program_forms_scale_plus_one_before_the_product(dtype):
    """The optimized program of a deviceless H100 compile adds 1 to the (n,) scale and
    multiplies after; no full-size add remains (the distributed ``a * scale + a`` would
    add two (rows, n) arrays)."""
    from helpers import aot_target
    from jax.sharding import PartitionSpec as P

    from rmsnorm_jax import aot

    target = aot_target("h100")
    mesh = target.mesh((1,), ("d",))
    x = aot.struct((64, 1024), dtype, mesh, P())
    s = aot.struct((1024,), jnp.float32, mesh, P())
    norm = jax.jit(lambda x, s: rms_norm(x, s, scale_offset=1.0, implementation="xla"))
    text = target.compile(norm, x, s).as_text()
    adds = re.findall(r"= (f32\[[\d,]*\])\{?[\d,]*\}? add\(", text)
    assert "f32[1024]" in adds, adds  # scale + 1, once, on the (n,) vector
    assert "f32[64,1024]" not in adds, adds
