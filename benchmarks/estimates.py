"""The TPU and GPU compilers' own view of the benchmarks' programs, without a device.

Every program is compiled for one device of a target (``rmsnorm_jax.aot``: the real XLA:TPU
and XLA:GPU compilers, no hardware) and reported by what the compiled program says: its
temporary memory, its kernels and the compiler's cost-model estimate of each (TPU: cycles;
GPU: microseconds). Estimates, not hardware timings: nothing runs and nothing is autotuned,
and a loop body counts once.

- :func:`estimate_shape`, :func:`estimate_fused`: the isolated ops of ``peers``, forward and
  forward+backward, beside the copy and traffic baselines compiled the same way;
- :func:`train_step_memory`: the pre-norm stack's train step per MLP and norm: temporary
  memory, and its kernels split into matmuls and the rest (:func:`split_kernels`);
- :func:`train_step_cost`: the estimate of a whole (unrolled) step per norm;
- :func:`gemma_step`: the Gemma-3-style step per norm, unrolled or scanned;
- :func:`maxtext_step`: the MaxText-shaped step per norm, scanned or unrolled, per remat
  policy.

Needs ``JAX_PLATFORMS=cpu`` set before jax is imported and the ``aot`` extra.
"""

from __future__ import annotations

import re
import time

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from rmsnorm_jax import aot

from . import models
from .peers import (
    FUSED,
    IMPLEMENTATIONS,
    MAXTEXT_NORMS,
    STEP_FLOOR,
    copy_baseline,
    forward_backward,
    fused_forward_backward,
    gemma_norms,
    scale_only,
    traffic_baseline,
)

MEMORY_FLOOR = STEP_FLOOR
MEMORY_NORMS = (
    "rms_norm",
    "add_rms_norm",
    "flax RMSNorm",
    "flax LayerNorm",
    "jnp + autodiff",
    MEMORY_FLOOR,
)
COST_NORMS = ("rms_norm", "flax RMSNorm", "flax LayerNorm", "jnp + autodiff")
GEMMA_MODES = ("unrolled", "scan")
MAXTEXT_MODES = ("scan", "unrolled")


def target(name: str) -> aot.Target:
    """The target called ``name``, refused when its compiler has no cost model."""
    found = aot.get_target(name)
    if found.estimate_unit is None:
        tpus = ", ".join(n for n in aot.target_names() if n.startswith("tpu"))
        raise ValueError(
            f"--target {name}: the compiler has no cost model for {found.name} in this jaxlib, "
            "so there is nothing to estimate (its programs still compile, with their "
            f"memory: `python examples/train_lm.py --compile-for {name}`, or rmsnorm_jax.aot); "
            f"pick h100 or a TPU ({tpus})."
        )
    return found


def unit_name(target: aot.Target) -> str:
    return {"cycles": "TPU cycles", "us": "microseconds"}[target.estimate_unit]


def _one_device(target: aot.Target):
    return jax.sharding.Mesh(target.devices[:1], ("d",))


def _compiled_estimate(target, fn, *args) -> tuple[float, int]:
    compiled = target.compile(jax.jit(fn), *args)
    kernels = aot.kernels(compiled, target)
    return sum(k.estimate for k in kernels), len(kernels)


# ---------------------------------------------------------------- isolated ops


def estimate_shape(target: aot.Target, rows: int, features: int, dtype) -> list[dict]:
    """One dict per implementation (and the baseline) for x of ``rows x features``: the
    estimates and kernel counts, forward and forward+backward, with the ratios to the
    baselines and the speed-up over flax's RMSNorm."""
    mesh = _one_device(target)
    x = aot.struct((rows, features), dtype, mesh, P())
    scale = aot.struct((features,), dtype, mesh, P())
    programs = {"baseline": (copy_baseline, traffic_baseline)}
    programs.update({name: (fn, forward_backward(fn)) for name, fn in IMPLEMENTATIONS.items()})
    results = []
    for name, (fwd, fwd_bwd) in programs.items():
        fwd_est, fwd_kernels = _compiled_estimate(target, fwd, x, scale)
        fb_est, fb_kernels = _compiled_estimate(target, fwd_bwd, x, scale, x)
        results.append(
            dict(
                impl=name,
                rows=rows,
                features=features,
                dtype=jnp.dtype(dtype).name,
                fwd=fwd_est,
                fwd_kernels=fwd_kernels,
                fwd_bwd=fb_est,
                fwd_bwd_kernels=fb_kernels,
            )
        )
    copy, traffic = results[0]["fwd"], results[0]["fwd_bwd"]
    flax = next(r for r in results if r["impl"] == "flax RMSNorm")
    for r in results:
        r["fwd_vs_baseline"] = r["fwd"] / copy
        r["fwd_bwd_vs_baseline"] = r["fwd_bwd"] / traffic
        r["fwd_bwd_speedup_vs_flax"] = flax["fwd_bwd"] / r["fwd_bwd"]
    return results


def estimate_fused(target: aot.Target, rows: int, features: int, dtype) -> dict[str, float]:
    """The compiler's forward+backward estimate of each fused op and its composition."""
    mesh = _one_device(target)
    x = aot.struct((rows, features), dtype, mesh, P())
    scale = aot.struct((features,), dtype, mesh, P())
    return {
        name: _compiled_estimate(target, fused_forward_backward(fn), x, x, scale, x)[0]
        for name, fn in FUSED.items()
    }


# ---------------------------------------------------------------- kernels of a program

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.-]+)\s.*\{\s*$")
_CALLS = re.compile(r"calls=%?([\w.-]+)")
_MATMUL = re.compile(r"\b(?:dot|convolution)\(|__cublas|__triton_gemm|cudnn")


def _computations(text: str) -> dict[str, str]:
    """The body of every computation of an HLO module, by name."""
    bodies, name, lines = {}, None, []
    for line in text.splitlines():
        match = _COMPUTATION.match(line)
        if match and not line.startswith(" "):
            name, lines = match.group(1), []
        elif line.startswith("}") and name is not None:
            bodies[name] = "\n".join(lines)
            name = None
        elif name is not None:
            lines.append(line)
    return bodies


def _is_matmul(line: str, bodies: dict[str, str], depth: int = 0) -> bool:
    if _MATMUL.search(line):
        return True
    if depth > 3:
        return False
    return any(
        _is_matmul(bodies.get(callee, ""), bodies, depth + 1) for callee in _CALLS.findall(line)
    )


def split_kernels(compiled, target: aot.Target) -> tuple[list[aot.Kernel], list[aot.Kernel]]:
    """``(matmul kernels, the others)`` of ``compiled``: a kernel is a matmul when it, or
    a computation it calls, holds a dot or a convolution (or is a cuBLAS/cuDNN call)."""
    text = compiled.as_text()
    bodies = _computations(text)
    lines = {}
    for line in text.splitlines():
        match = re.match(r"^\s*(?:ROOT\s+)?%?([\w.-]+)\s*=", line)
        if match:
            lines.setdefault(match.group(1), line)
    matmul, other = [], []
    for kernel in aot.kernels(compiled, target):
        (matmul if _is_matmul(lines.get(kernel.name, ""), bodies) else other).append(kernel)
    return matmul, other


def kernel_fields(compiled, target: aot.Target) -> dict:
    """The kernels of a compiled step: how many, the matmuls and the rest with the sums of
    their estimates, and the five costliest of the rest (name, estimate)."""
    matmul, other = split_kernels(compiled, target)
    return dict(
        kernels=len(matmul) + len(other),
        matmul_kernels=len(matmul),
        matmul_estimate=sum(k.estimate for k in matmul),
        other_kernels=len(other),
        other_estimate=sum(k.estimate for k in other),
        costliest_other=[
            (k.name, k.estimate) for k in sorted(other, key=lambda k: -k.estimate)[:5]
        ],
    )


def _hbm_refusal(err: Exception) -> float | None:
    """Bytes the TPU compiler asked for when it refused a program that exceeds the chip's
    HBM (it says how much its temporaries need), else None."""
    need = re.search(r"HLO temporaries \(([\d.]+)G\)", str(err))
    return None if need is None else float(need.group(1)) * 2**30


# ---------------------------------------------------------------- the pre-norm train step


def compile_train_step(target: aot.Target, norm, d: int, tokens: int, dtype, **model):
    """One SGD step of :func:`models.prenorm_stack_train_step` (``model``: its options),
    compiled for one device of ``target``."""
    mesh = _one_device(target)
    step, shapes = models.prenorm_stack_train_step(norm, **model)
    params = jax.tree.map(
        lambda s: aot.struct(s.shape, s.dtype, mesh, P()), shapes(d, jnp.dtype(dtype))
    )
    h = aot.struct((tokens, d), jnp.dtype(dtype), mesh, P())
    return target.compile(jax.jit(step, donate_argnums=0), params, h)


def train_step_memory(
    target: aot.Target,
    norm_names=MEMORY_NORMS,
    d: int = 2048,
    tokens: int = 16384,
    mlps=models.MLPS,
    layers: int = 8,
) -> list[dict]:
    """One bfloat16 SGD step of the block stack (``lax.scan`` over ``layers``), per MLP and
    norm: temporary bytes per device and the kernels (:func:`kernel_fields`).

    One dict per (mlp, norm), with ``vs_flax`` (against ``flax RMSNorm`` with the same MLP)
    and ``vs_floor`` (against ``scale_only``, the least a scaled norm can keep). ``fits``
    is False where the TPU compiler refused the program for the chip's HBM; then
    ``temp_bytes`` is what it asked for.
    """
    norms = {**IMPLEMENTATIONS, "add_rms_norm": None, MEMORY_FLOOR: scale_only}
    out = []
    for mlp in mlps:
        rows = []
        for name in norm_names:
            row = dict(mlp=mlp, norm=name)
            try:
                compiled = compile_train_step(
                    target, norms[name], d, tokens, jnp.bfloat16, mlp=mlp, layers=layers
                )
            except jax.errors.JaxRuntimeError as err:
                if _hbm_refusal(err) is None:
                    raise
                row.update(temp_bytes=_hbm_refusal(err), fits=False)
            else:
                row.update(temp_bytes=compiled.memory_analysis().temp_size_in_bytes, fits=True)
                row.update(kernel_fields(compiled, target))
            rows.append(row)
        flax = next((r["temp_bytes"] for r in rows if r["norm"] == "flax RMSNorm"), None)
        floor = next((r["temp_bytes"] for r in rows if r["norm"] == MEMORY_FLOOR), None)
        for r in rows:
            r["vs_flax"] = ratio(r["temp_bytes"], flax)
            r["vs_floor"] = ratio(r["temp_bytes"], floor)
        out.extend(rows)
    return out


def ratio(value: float | None, base: float | None) -> float | None:
    """``value / base``, or None where there is no base or it is 0. A TPU compiler keeps
    a small step's temporaries in on-chip memory (VMEM, CMEM), so its HBM temp bytes can
    be 0: e.g. the ``--quick`` step (2 blocks, d 256, 512 tokens) on TPU v4, v5e, v6e and
    TPU7x, where a ratio says nothing."""
    if value is None or not base:
        return None
    return value / base


def train_step_cost(
    target: aot.Target,
    norm_names=COST_NORMS,
    d: int = 1024,
    tokens: int = 8192,
    dtypes=("float32", "bfloat16"),
    layers: int = 2,
) -> list[dict]:
    """The compiler's estimate of one whole SGD step of the block stack, per norm.

    The isolated forward+backward programs of :func:`estimate_shape` take the cotangent
    ``dy`` as an input, so XLA may compute ``y`` inside the backward's reduction kernel; in
    a network ``dy`` depends on ``y`` and it cannot. This is the same comparison where ``y``
    feeds a matmul and ``dy`` comes back through it: the SwiGLU stack of
    :func:`models.prenorm_stack_train_step` with its scan unrolled (a loop body would be
    counted once), parameters and activations in ``dtype``.
    """
    out = []
    for dtype in dtypes:
        rows = []
        for name in norm_names:
            compiled = compile_train_step(
                target,
                IMPLEMENTATIONS[name],
                d,
                tokens,
                dtype,
                layers=layers,
                mlp="swiglu",
                unroll=True,
            )
            rows.append(dict(dtype=dtype, norm=name, step=aot.estimate(compiled, target)))
        ours = rows[0]["step"]
        for r in rows:
            r["vs_ours"] = ratio(r["step"], ours)
            r["minus_ours"] = r["step"] - ours
        out.extend(rows)
    return out


# ---------------------------------------------------------------- the Gemma-3-style step


def _compile_on_one_device(target: aot.Target, step, shapes) -> jax.stages.Compiled:
    """``step(*shapes)`` compiled for one device of ``target``, its first two arguments
    (the parameters and the optimizer state) donated."""
    mesh = _one_device(target)
    structs = jax.tree.map(lambda s: aot.struct(s.shape, s.dtype, mesh, P()), shapes)
    return target.compile(jax.jit(step, donate_argnums=(0, 1)), *structs)


def _step_record(target: aot.Target, record: dict, compile_step, extra=()) -> tuple:
    """``(record, compiled)`` with the compiled step's temp memory, kernels and the
    estimates of the whole step and of its non-matmul kernels (and the ``extra`` fields
    of :func:`kernel_fields`); ``compiled`` None where the TPU compiler refused the
    program for its HBM (then ``temp_bytes`` is what it asked for)."""
    start = time.perf_counter()
    try:
        compiled = compile_step()
    except jax.errors.JaxRuntimeError as err:
        refused = _hbm_refusal(err)
        if refused is None:
            raise
        record.update(fits=False, temp_bytes=refused, compile_s=time.perf_counter() - start)
        return record, None
    fields = kernel_fields(compiled, target)
    record.update(
        fits=True,
        temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
        kernels=fields["kernels"],
        step=fields["matmul_estimate"] + fields["other_estimate"],
        non_matmul=fields["other_estimate"],
        **{key: fields[key] for key in extra},
        compile_s=time.perf_counter() - start,
    )
    return record, compiled


def compile_gemma_step(
    target: aot.Target, cfg: models.Config, norm, scan: bool, batch: int, seq: int
):
    """The train step compiled for one device of ``target`` (params and state donated)."""
    step = models.gemma_train_step(cfg, norm, scan)
    return _compile_on_one_device(target, step, models.gemma_step_shapes(cfg, scan, batch, seq))


def gemma_step(target: aot.Target, cfg: models.Config, name: str, mode: str, batch: int, seq: int):
    """``(record, compiled)``: temp memory, kernels and the estimates of one norm in one
    mode (``compiled`` None where the TPU compiler refused the program for its HBM)."""
    record = dict(norm=name, mode=mode, batch=batch, seq=seq, layers=cfg.layers)
    norm = gemma_norms()[name]
    return _step_record(
        target, record, lambda: compile_gemma_step(target, cfg, norm, mode == "scan", batch, seq)
    )


# ---------------------------------------------------------------- the MaxText-shaped step


def compile_maxtext_step(
    target: aot.Target,
    cfg: models.MaxTextConfig,
    norm,
    scan: bool,
    remat: str,
    batch: int,
    seq: int,
):
    """The train step compiled for one device of ``target`` (params and state donated)."""
    step = models.maxtext_train_step(cfg, norm, scan, remat)
    return _compile_on_one_device(target, step, models.maxtext_step_shapes(cfg, scan, batch, seq))


def maxtext_step(
    target: aot.Target,
    cfg: models.MaxTextConfig,
    name: str,
    mode: str,
    remat: str,
    batch: int,
    seq: int,
):
    """``(record, compiled)`` of one norm of ``MAXTEXT_NORMS`` in one mode (``"scan"`` or
    ``"unrolled"``) and remat policy: temp memory, kernels (matmuls apart), the estimate
    of the whole step and of its non-matmul kernels (``compiled`` None where the TPU
    compiler refused the program for its HBM)."""
    record = dict(norm=name, mode=mode, remat=remat, batch=batch, seq=seq, layers=cfg.layers)
    norm = MAXTEXT_NORMS[name]
    return _step_record(
        target,
        record,
        lambda: compile_maxtext_step(target, cfg, norm, mode == "scan", remat, batch, seq),
        extra=("matmul_kernels", "costliest_other"),
    )
