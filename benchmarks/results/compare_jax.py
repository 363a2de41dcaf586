"""The deviceless compiles of two jax versions side by side, as markdown tables on stdout.

    python benchmarks/results/compare_jax.py benchmarks/results/jax0.10.2 \
        benchmarks/results/jax0.12.0.1

Reads what ``python -m benchmarks estimates --target T`` and ``gemma --target T`` wrote in
each directory (T: h100, tpu-v5e). A cell is ``old → new``, or one value where both print
alike. The ops and fused-op tables list our programs that moved by more than 0.2 % (the
counts above them include the peers' programs). Where the TPU compiler refused a program
for the chip's HBM (fits False), temp MiB is what it asked for.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OURS = ("rms_norm", "rms_norm p=0.0625", "RMSNorm module", "add_rms_norm", "gated_rms_norm")
# (column, JSON key, digits); temp_bytes is shown in MiB
OPS = [
    ("fwd kernels", "fwd_kernels", 0),
    ("fwd / copy", "fwd_vs_baseline", 3),
    ("fwd+bwd kernels", "fwd_bwd_kernels", 0),
    ("fwd+bwd", "fwd_bwd", 1),
    ("fwd+bwd / traffic", "fwd_bwd_vs_baseline", 3),
    ("flax / ours, fwd+bwd", "fwd_bwd_speedup_vs_flax", 3),
]
FUSED = [("fwd+bwd", "fwd_bwd", 1), ("ours / composition", "vs_composition", 3)]
MEMORY = [
    ("fits", "fits", 0),
    ("temp MiB", "temp_bytes", 0),
    ("kernels", "kernels", 0),
    ("non-matmul estimate", "other_estimate", 0),
    ("vs flax", "vs_flax", 3),
    ("vs floor", "vs_floor", 3),
]
COST = [("step", "step", 0), ("vs rms_norm", "vs_ours", 4)]
GEMMA = [
    ("temp MiB", "temp_bytes", 0),
    ("vs gemma's", "temp_bytes_vs_gemma", 3),
    ("kernels", "kernels", 0),
    ("step", "step", 0),
    ("vs gemma's", "step_vs_gemma", 3),
    ("non-matmul", "non_matmul", 0),
    ("vs gemma's", "non_matmul_vs_gemma", 3),
]


def _value(record: dict, key: str):
    value = record.get(key)
    return value / 2**20 if key == "temp_bytes" else value


def _text(value, digits: int) -> str:
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def _moved(a, b, tolerance: float) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return abs(b - a) > tolerance * abs(a)
    return a != b


def table(old, new, key, fields, keep=lambda r: True, tolerance=None) -> str:
    """``old`` and ``new`` joined on the ``key`` fields; with ``tolerance``, only the rows
    where some field moved by more than that fraction."""
    by_key = {tuple(r[k] for k in key): r for r in new}
    lines = ["| " + " | ".join([*key, *(f[0] for f in fields)]) + " |"]
    lines.append("|" + "---|" * len(key) + "---:|" * len(fields))
    for a in filter(keep, old):
        b = by_key.get(tuple(a[k] for k in key))
        if b is None:
            continue
        pairs = [(_value(a, f), _value(b, f), d) for _, f, d in fields]
        moved = any(_moved(x, y, tolerance or 0.0) for x, y, _ in pairs)
        if tolerance is not None and not moved:
            continue
        cells = [
            _text(x, d) if _text(x, d) == _text(y, d) else f"{_text(x, d)} → {_text(y, d)}"
            for x, y, d in pairs
        ]
        lines.append("| " + " | ".join([*(str(a[k]) for k in key), *cells]) + " |")
    if len(lines) == 2:
        return f"None moved by more than {tolerance:.1%}.\n"
    return "\n".join(lines) + "\n"


def counts(old, new, key, fields) -> str:
    """How many of the programs changed at all, per field."""
    by_key = {tuple(r[k] for k in key): r for r in new}
    pairs = [(a, by_key[tuple(a[k] for k in key)]) for a in old]
    return ", ".join(f"{f} {sum(a[f] != b[f] for a, b in pairs)}" for f in fields)


def main(old: str, new: str) -> None:
    def load(directory, name):
        path = Path(directory) / name
        return json.loads(path.read_text()) if path.exists() else None

    ours = lambda r: r["impl"] in OURS
    shape = ("impl", "features", "dtype")
    for stem in ("h100", "tpu-v5e_2x2"):
        a, b = load(old, f"{stem}.json"), load(new, f"{stem}.json")
        if a and b:
            fa, fb = load(old, f"{stem}-fused.json"), load(new, f"{stem}-fused.json")
            n = len(a["results"])
            fields = ("fwd_kernels", "fwd", "fwd_bwd_kernels", "fwd_bwd")
            print(f"## {stem}: estimates ({a['unit']})\n")
            changed = counts(a["results"], b["results"], shape, fields)
            print(f"Ops programs ({n}) changed: {changed}.\n")
            print(table(a["results"], b["results"], shape, OPS, ours, 0.002))
            print(f"Fused programs ({len(fa)}) changed: {counts(fa, fb, shape, ('fwd_bwd',))}.\n")
            print(table(fa, fb, shape, FUSED, ours, 0.002))
            print("Train step (scan, 8 layers), memory and kernels\n")
            print(table(a["memory"], b["memory"], ("mlp", "norm"), MEMORY))
            print("Whole unrolled step, the compiler's estimate\n")
            print(table(a["step_cost"], b["step_cost"], ("dtype", "norm"), COST))
        a, b = load(old, f"gemma-{stem}.json"), load(new, f"gemma-{stem}.json")
        if a and b:
            print(f"## {stem}: Gemma-3-style step ({a['unit']})\n")
            print(table(a["records"], b["records"], ("mode", "norm"), GEMMA))


if __name__ == "__main__":
    main(*sys.argv[1:3])
