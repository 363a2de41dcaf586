"""python -m benchmarks.compare_jax OLD_DIR NEW_DIR: the deviceless compiles of two jax
versions side by side (what ``estimates --target T`` and ``gemma --target T`` wrote in each
folder; T: h100, tpu-v5e), as markdown tables. A cell is ``old → new``, or one value where
both print alike; the ops and fused-op tables list our programs that moved by more than
0.2 %. Where the TPU compiler refused a program for its HBM, temp MiB is what it asked for.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from . import report

OURS = ("rms_norm", "rms_norm p=0.0625", "RMSNorm module", "add_rms_norm", "gated_rms_norm")
# (column, JSON key, digits); temp_bytes is shown in MiB
OPS = [("fwd kernels", "fwd_kernels", 0), ("fwd / copy", "fwd_vs_baseline", 3),
       ("fwd+bwd kernels", "fwd_bwd_kernels", 0), ("fwd+bwd", "fwd_bwd", 1),
       ("fwd+bwd / traffic", "fwd_bwd_vs_baseline", 3),
       ("flax / ours, fwd+bwd", "fwd_bwd_speedup_vs_flax", 3)]  # fmt: skip
FUSED = [("fwd+bwd", "fwd_bwd", 1), ("ours / composition", "vs_composition", 3)]
MEMORY = [("fits", "fits", 0), ("temp MiB", "temp_bytes", 0), ("kernels", "kernels", 0),
          ("non-matmul estimate", "other_estimate", 0), ("vs flax", "vs_flax", 3),
          ("vs floor", "vs_floor", 3)]  # fmt: skip
COST = [("step", "step", 0), ("vs rms_norm", "vs_ours", 4)]
GEMMA = [("temp MiB", "temp_bytes", 0), ("vs gemma's", "temp_bytes_vs_gemma", 3),
         ("kernels", "kernels", 0), ("step", "step", 0), ("vs gemma's", "step_vs_gemma", 3),
         ("non-matmul", "non_matmul", 0), ("vs gemma's", "non_matmul_vs_gemma", 3)]  # fmt: skip


def _text(value, digits: int) -> str:
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def _moved(x, y, tolerance: float) -> bool:
    numbers = isinstance(x, float) and isinstance(y, float)
    return abs(y - x) > tolerance * abs(x) if numbers else x != y


def table(old, new, key, fields, keep=lambda r: True, tolerance=None) -> str:
    """``old`` and ``new`` joined on ``key``; with ``tolerance``, only the rows where a
    field moved by more than that fraction."""
    by_key, rows = {tuple(r[k] for k in key): r for r in new}, []
    value = lambda r, f: r.get(f) / 2**20 if f == "temp_bytes" else r.get(f)
    for a in filter(keep, old):
        if (b := by_key.get(tuple(a[k] for k in key))) is None:
            continue
        pairs = [(value(a, f), value(b, f), d) for _, f, d in fields]
        if tolerance is not None and not any(_moved(x, y, tolerance) for x, y, _ in pairs):
            continue
        cell = lambda x, y, d: (
            _text(x, d) if _text(x, d) == _text(y, d) else f"{_text(x, d)} → {_text(y, d)}"
        )
        rows.append([*(a[k] for k in key), *(cell(*p) for p in pairs)])
    if not rows:
        return f"None moved by more than {tolerance:.1%}.\n"
    head = " | ".join([*key, *(f[0] for f in fields)])
    return report.table(head, rows, "l" * len(key) + "r" * len(fields)) + "\n"


def counts(old, new, key, fields) -> str:
    """How many of the programs changed at all, per field."""
    by_key = {tuple(r[k] for k in key): r for r in new}
    pairs = [(a, by_key[tuple(a[k] for k in key)]) for a in old]
    return ", ".join(f"{f} {sum(a[f] != b[f] for a, b in pairs)}" for f in fields)


def main(old: str, new: str) -> None:
    def load(directory, name):
        path = Path(directory) / name
        return json.loads(path.read_text()) if path.exists() else None

    ours, shape = lambda r: r["impl"] in OURS, ("impl", "features", "dtype")
    for stem in ("h100", "tpu-v5e_2x2"):
        if (a := load(old, f"{stem}.json")) and (b := load(new, f"{stem}.json")):
            fa, fb = load(old, f"{stem}-fused.json"), load(new, f"{stem}-fused.json")
            fields = ("fwd_kernels", "fwd", "fwd_bwd_kernels", "fwd_bwd")
            print(f"## {stem}: estimates ({a['unit']})\n")
            changed = counts(a["results"], b["results"], shape, fields)
            print(f"Ops programs ({len(a['results'])}) changed: {changed}.\n")
            print(table(a["results"], b["results"], shape, OPS, ours, 0.002))
            print(f"Fused programs ({len(fa)}) changed: {counts(fa, fb, shape, ('fwd_bwd',))}.\n")
            print(table(fa, fb, shape, FUSED, ours, 0.002))
            print("Train step (scan, 8 layers), memory and kernels\n")
            print(table(a["memory"], b["memory"], ("mlp", "norm"), MEMORY))
            print("Whole unrolled step, the compiler's estimate\n")
            print(table(a["step_cost"], b["step_cost"], ("dtype", "norm"), COST))
        if (a := load(old, f"gemma-{stem}.json")) and (b := load(new, f"gemma-{stem}.json")):
            print(f"## {stem}: Gemma-3-style step ({a['unit']})\n")
            print(table(a["records"], b["records"], ("mode", "norm"), GEMMA))


if __name__ == "__main__":
    main(*sys.argv[1:3])
