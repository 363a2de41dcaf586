"""Smoke test of an installed wheel, run from outside the checkout by .ci/run.

It checks that the package imports from site-packages (not from a checkout), that the
README's quickstart gives the formula's numbers, that the fused kernels run (Pallas
interpret mode on the CPU), and, when the ``aot`` extra is installed, that the packaged
compile targets load and compile for a TPU and a GPU.
"""

import importlib.util
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

import rmsnorm_jax
from rmsnorm_jax import aot, rms_norm

package = Path(rmsnorm_jax.__file__).resolve().parent
assert "site-packages" in package.parts, f"imported from {package}, not from the wheel"
print(f"rmsnorm_jax {rmsnorm_jax.__version__} from {package}")

# The README's quickstart, against the formula in NumPy float64.
x = jax.random.normal(jax.random.key(0), (4, 512), jnp.bfloat16)
scale = jnp.ones((512,), jnp.float32)
x64 = np.asarray(x, np.float64)
expected = x64 / np.sqrt(np.mean(x64**2, axis=-1, keepdims=True) + 1e-6)
y = rms_norm(x, scale)
np.testing.assert_allclose(np.asarray(y, np.float64), expected, rtol=1e-2, atol=1e-2)
y_p = rms_norm(x, scale, p=0.0625)
expected_p = x64 / np.sqrt(np.mean(x64[:, :32] ** 2, axis=-1, keepdims=True) + 1e-6)
np.testing.assert_allclose(np.asarray(y_p, np.float64), expected_p, rtol=1e-2, atol=1e-2)
dx, dscale = jax.grad(lambda x, s: rms_norm(x, s).astype(jnp.float32).sum(), (0, 1))(x, scale)
assert dx.dtype == jnp.bfloat16 and dscale.dtype == jnp.float32
print("quickstart: ok")

# The fused kernels, in Pallas interpret mode on the CPU.
x32 = np.asarray(x, np.float32)
y_kernel = rms_norm(jnp.asarray(x32), scale, implementation="pallas")
expected32 = x32 / np.sqrt(np.mean(x32.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-6)
np.testing.assert_allclose(np.asarray(y_kernel), expected32, rtol=1e-5, atol=1e-5)
print("pallas (interpret mode): ok")

if importlib.util.find_spec("libtpu") is None:
    print("aot: the extra is not installed, skipped")
    sys.exit(0)

for name in ("tpu-v5e", "h100", "a100"):
    target = aot.get_target(name)
    mesh = target.mesh((len(target.devices),), ("data",))
    xs = aot.struct((1024, 4096), jnp.bfloat16, mesh, jax.sharding.PartitionSpec())
    compiled = target.compile(jax.jit(rms_norm), xs)
    print(f"aot {target.name}: compiled, estimate {aot.estimate(compiled, target)}")
