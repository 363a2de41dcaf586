"""The Gemma-3-style train step (``gemma.py``) compiled for TPU and GPU without a device.

    python benchmarks/gemma_bench.py --target h100          # Gemma 3 270M, batch 8 x 1024
    python benchmarks/gemma_bench.py --target tpu-v5e --quick

For each norm of ``gemma.NORMS``, with the blocks unrolled and under ``lax.scan``, one
train step (loss, gradient, AdamW; bfloat16 activations, float32 weights) is compiled
for one device of the target and reported: temporary memory per device, the number of
kernels, and the compiler's estimate of the whole step and of its non-matmul part (every
kernel that holds no dot or convolution). A loop body counts once, so the estimates of
the scanned programs cover one block: compare norms within a mode, not across modes.
When the TPU compiler refuses a program that does not fit in HBM, the memory column
shows what it asked for. ``--norms "x * (1 + scale) (floor)"`` adds the memory floor: the
step with ``x * (1 + scale)`` in place of every norm, which keeps for its backward what
any norm with a learnable scale must keep.

Writes ``gemma-<target>.json`` and ``.md`` into ``--out``. Every number is the
compiler's estimate of a deviceless compile, not a hardware timing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before jax: see rmsnorm_jax.aot
sys.path.insert(0, str(Path(__file__).parent))

import gemma
import jax
from jax.sharding import PartitionSpec as P

from rmsnorm_jax import aot

MODES = ("unrolled", "scan")
# The norms, and the memory floor (not a norm; compiled only when named in --norms).
COMPARED = {**gemma.NORMS, gemma.FLOOR: gemma.scale_only}

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


def compile_step(target: aot.Target, cfg: gemma.Config, norm, scan: bool, batch: int, seq: int):
    """The train step compiled for one device of ``target`` (params and state donated)."""
    mesh = jax.sharding.Mesh(target.devices[:1], ("d",))
    shapes = gemma.step_shapes(cfg, scan, batch, seq)
    structs = jax.tree.map(lambda s: aot.struct(s.shape, s.dtype, mesh, P()), shapes)
    step = jax.jit(gemma.train_step(cfg, norm, scan), donate_argnums=(0, 1))
    return target.compile(step, *structs)


def measure(target: aot.Target, cfg: gemma.Config, name: str, mode: str, batch: int, seq: int):
    """One record: temp memory, kernels and the estimates of one norm in one mode."""
    start = time.perf_counter()
    record = dict(norm=name, mode=mode, batch=batch, seq=seq, layers=cfg.layers)
    try:
        compiled = compile_step(target, cfg, COMPARED[name], mode == "scan", batch, seq)
    except jax.errors.JaxRuntimeError as err:
        need = re.search(r"HLO temporaries \(([\d.]+)G\)", str(err))
        if need is None:
            raise
        record.update(fits=False, temp_bytes=float(need.group(1)) * 2**30)
        record["compile_s"] = time.perf_counter() - start
        return record, None
    matmul, other = split_kernels(compiled, target)
    record.update(
        fits=True,
        temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
        kernels=len(matmul) + len(other),
        step=sum(k.estimate for k in matmul + other),
        non_matmul=sum(k.estimate for k in other),
        compile_s=time.perf_counter() - start,
    )
    return record, compiled


def _relative(records: list[dict]) -> None:
    """Adds each record's ratios to ``gemma's own`` norm in the same mode."""
    for r in records:
        base = next(
            (b for b in records if b["mode"] == r["mode"] and b["norm"] == "gemma's own"), None
        )
        if base is None:
            continue
        for key in ("temp_bytes", "step", "non_matmul"):
            if r.get(key) is not None and base.get(key):
                r[f"{key}_vs_gemma"] = r[key] / base[key]
        if r.get("kernels") is not None and base.get("kernels") is not None:
            r["kernels_minus_gemma"] = r["kernels"] - base["kernels"]


def markdown(target: aot.Target, records: list[dict]) -> str:
    unit = target.estimate_unit
    lines = [
        f"| mode | norm | temp MiB | vs gemma's | kernels | minus gemma's | step ({unit}) "
        f"| vs gemma's | non-matmul ({unit}) | vs gemma's |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    fmt = (lambda v: f"{v:,.0f}") if unit == "cycles" else (lambda v: f"{v:,.1f}")
    for r in records:
        temp = f"{r['temp_bytes'] / 2**20:,.0f}" + ("" if r["fits"] else " (does not fit)")
        cells = [r["mode"], r["norm"], temp, _ratio(r, "temp_bytes")]
        if r["fits"]:
            cells += [
                str(r["kernels"]),
                f"{r.get('kernels_minus_gemma', 0):+d}",
                fmt(r["step"]),
                _ratio(r, "step"),
                fmt(r["non_matmul"]),
                _ratio(r, "non_matmul"),
            ]
        else:
            cells += ["", "", "", "", "", ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratio(r: dict, key: str) -> str:
    value = r.get(f"{key}_vs_gemma")
    return "" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="h100, tpu-v5e, tpu-v6e, ...")
    parser.add_argument("--quick", action="store_true", help="the small config (tests)")
    parser.add_argument("--batch", type=int, default=None, help="default 8 (quick: 2)")
    parser.add_argument("--seq", type=int, default=None, help="default 1024 (quick: 64)")
    parser.add_argument("--norms", default=",".join(gemma.NORMS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--hlo-dir", default=None, help="also write each optimized program")
    parser.add_argument(
        "--merge",
        default=None,
        help="a JSON of an earlier run: its records for the norms and modes not compiled "
        "in this run are kept (e.g. the peers, when only rms_norm changed)",
    )
    args = parser.parse_args(argv)
    target = aot.get_target(args.target)
    cfg = gemma.SMALL if args.quick else gemma.GEMMA3_270M
    batch = args.batch or (2 if args.quick else 8)
    seq = args.seq or (64 if args.quick else 1024)
    stem = "gemma-" + target.name.replace(":", "_") + ("-quick" if args.quick else "")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header = (
        f"Target: {target.name} ({target.devices[0].device_kind}), jax {jax.__version__}. "
        f"Gemma-3-style train step (`benchmarks/gemma.py`: {cfg.layers} blocks, d {cfg.d}, "
        f"{cfg.heads} query heads / {cfg.kv_heads} KV head of {cfg.head_dim}, MLP "
        f"{cfg.hidden}, vocab {cfg.vocab:,}, window {cfg.window}), batch {batch} x {seq}, "
        "loss + grad + AdamW, bfloat16 activations, float32 weights, one device. "
        "Every number is from a deviceless compile: temp memory from the compiled program, "
        f"estimates in {unit_name(target)} from the compiler's cost model (not a hardware "
        "timing). Under `scan` a loop body counts once in the estimates and kernels.\n\n"
    )
    records = json.loads(Path(args.merge).read_text())["records"] if args.merge else []
    for mode in args.modes.split(","):
        for name in args.norms.split(","):
            record, compiled = measure(target, cfg, name, mode, batch, seq)
            records = [r for r in records if (r["norm"], r["mode"]) != (name, mode)]
            records.append(record)
            records.sort(key=lambda r: (MODES.index(r["mode"]), list(COMPARED).index(r["norm"])))
            if args.hlo_dir and compiled is not None:
                hlo = Path(args.hlo_dir)
                hlo.mkdir(parents=True, exist_ok=True)
                safe = re.sub(r"[^\w]+", "_", name)
                (hlo / f"{stem}-{mode}-{safe}.txt").write_text(compiled.as_text())
            print(json.dumps(record), flush=True)
            _relative(records)
            (out / f"{stem}.json").write_text(
                json.dumps(
                    {"target": target.name, "unit": target.estimate_unit, "records": records},
                    indent=1,
                )
            )
            (out / f"{stem}.md").write_text(header + markdown(target, records) + "\n")
    print(header + markdown(target, records))
    return records


def unit_name(target: aot.Target) -> str:
    return {"cycles": "TPU cycles", "us": "microseconds"}[target.estimate_unit]


if __name__ == "__main__":
    main()
