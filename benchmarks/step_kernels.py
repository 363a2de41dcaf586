"""Per-kernel view of the train step compiled for an H100, norm by norm (deviceless).

    python benchmarks/step_kernels.py [--mlp swiglu,gelu] [--dtype bfloat16] [--target h100]

Compiles ``implementations.prenorm_stack_train_step`` (8 layers under ``lax.scan``, d 2048,
16k tokens) with each norm and prints, per program: the number of kernels, the GEMM kernels
and the rest with the sums of XLA's cost-model estimates (not timings; GEMM estimates are
rough, reductions and elementwise sound), the compiled temp memory, and the costliest
non-GEMM kernels. Used to explain measured step times kernel by kernel (issue 17: SwiGLU
bfloat16).
"""

from __future__ import annotations

import argparse
import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # deviceless compiles (rmsnorm_jax.aot)

import aot_bench
import jax.numpy as jnp
from implementations import IMPLEMENTATIONS

from rmsnorm_jax import aot

NORMS = {name: IMPLEMENTATIONS[name] for name in ("rms_norm", "jnp + autodiff", "flax RMSNorm")}
NORMS["add_rms_norm"] = None  # every residual add fused into the next norm

_GEMM = re.compile(r"gemm|cublas|dot")


def step_kernels(target, norm, mlp: str, dtype, d: int = 2048, tokens: int = 16384) -> dict:
    compiled = aot_bench._compile_train_step(target, norm, d, tokens, dtype, mlp=mlp)
    kernels = aot.kernels(compiled, target)
    gemm = [k for k in kernels if _GEMM.search(k.name)]
    rest = [k for k in kernels if not _GEMM.search(k.name)]
    return dict(
        kernels=len(kernels),
        gemm=len(gemm),
        gemm_estimate=sum(k.estimate for k in gemm),
        other=len(rest),
        other_estimate=sum(k.estimate for k in rest),
        temp_mib=compiled.memory_analysis().temp_size_in_bytes / 2**20,
        costliest=sorted(((k.estimate, k.name) for k in rest), reverse=True)[:5],
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mlp", default="swiglu,gelu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--target", default="h100")
    parser.add_argument("--d", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=16384)
    args = parser.parse_args(argv)
    target = aot.get_target(args.target)
    unit = target.estimate_unit
    print(f"| mlp | norm | kernels | GEMM kernels ({unit}) | other kernels ({unit}) | temp MiB |")
    print("|---|---|---:|---:|---:|---:|")
    rows = []
    for mlp in args.mlp.split(","):
        for name, norm in NORMS.items():
            r = step_kernels(target, norm, mlp, jnp.dtype(args.dtype), args.d, args.tokens)
            rows.append((mlp, name, r))
            print(
                f"| {mlp} | {name} | {r['kernels']} | {r['gemm']} ({r['gemm_estimate']:,.0f}) "
                f"| {r['other']} ({r['other_estimate']:,.0f}) | {r['temp_mib']:,.0f} |",
                flush=True,
            )
    return rows


if __name__ == "__main__":
    main()
