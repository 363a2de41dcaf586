"""Every entry point with ``implementation="pallas"`` traces (forward and backward) at
every width and dtype mix a user may call it with, on each platform it can be compiled
for: the CPU (interpret mode), each TPU generation and the H100.

Trace-only (``jax.eval_shape``): a kernel that refuses a call its dispatch let through
(``fits`` against the kernel's own ``plan``) raises while tracing, so nothing needs to
compile. The widths straddle the kernels' limits (the GPU's 8192 features, each TPU
generation's VMEM) and the dtype mixes include the 16-bit/float32 pairs whose tile is
16 rows of float32-wide rows, the tightest case.
"""

import jax
import jax.numpy as jnp
import pytest
from helpers import aot_target

from rmsnorm_jax import add_rms_norm, rms_norm

pytestmark = pytest.mark.newest

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
WIDTHS = (1, 7, 100, 1000, 4096, 8192, 8193, 12288, 14336, 16384, 18432, 20480, 32768, 65536)
MIXES = ((BF16, BF16), (BF16, F32), (F32, BF16), (F16, F32), (F32, F32))
# Job 2 (the newest jax) traces for the H100 and TPU v5e; the others are job 1's (heavy).
TARGETS = [
    pytest.param(name, marks=() if name in ("h100", "tpu-v5e") else pytest.mark.heavy)
    for name in ("cpu", "tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e", "tpu7x", "h100")
]


def _loss(outs):
    return sum(o.astype(F32).sum() for o in jax.tree.leaves(outs))


ENTRY_POINTS = {
    "rms_norm": lambda x, r, s: rms_norm(x, s, implementation="pallas"),
    "rms_norm bias p": lambda x, r, s: rms_norm(x, s, bias=s, p=0.3, implementation="pallas"),
    "add_rms_norm": lambda x, r, s: add_rms_norm(x, r, s, implementation="pallas"),
    "add_rms_norm f32 stream": lambda x, r, s: add_rms_norm(
        x, r, s, residual_dtype=F32, implementation="pallas"
    ),
}


@pytest.mark.parametrize("target_name", TARGETS)
def test_every_width_and_dtype_mix_traces(target_name):
    target = aot_target(target_name)
    mesh = jax.sharding.Mesh(target.devices[:1], ("d",))
    failures = []
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        for n in WIDTHS:
            for x_dtype, r_dtype in MIXES:
                x = jax.ShapeDtypeStruct((16, n), x_dtype)
                r = jax.ShapeDtypeStruct((16, n), r_dtype)
                s = jax.ShapeDtypeStruct((n,), F32)
                for name, fn in ENTRY_POINTS.items():
                    grad = jax.grad(lambda x, r, s, fn=fn: _loss(fn(x, r, s)), (0, 1, 2))
                    try:
                        jax.eval_shape(grad, x, r, s)
                    except Exception as err:  # collected: one report for the whole sweep
                        failures.append(
                            f"{name} n={n} {x_dtype.__name__}/{r_dtype.__name__}: {err}"
                        )
    assert not failures, "\n".join(failures[:20])
