"""python -m benchmarks.goals RESULTS.json: a GPU run against the goals of issue 46, from its
``ops``, ``step`` and ``gemma`` sections -> markdown on stdout.

- The default path (``rms_norm``, ``"auto"``) at >= 95 % of the copy's rate forward and >= 90 %
  of its byte bound forward+backward, from 1024 to 32768 features (bfloat16; float32 beside).
- A QK-norm's 128 features at >= 80 %, forward and forward+backward.
- The fused add (``add_rms_norm``) at >= 90 % forward+backward.
- Where ``"auto"`` took a kernel: never slower than tokamax or our XLA path.
- A whole train step with ``"auto"`` never slower than with the XLA path alone.

A shape short of its goal says by how many points, and where its device time went: the
program's kernels and their time (CUPTI, the sample nearest the median)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import report
from .wins import step_times

FORWARD, BOTH, QK, ADD = 95.0, 90.0, 80.0, 90.0
WIDEST = 32768


def goal(impl: str, kind: str, features: int) -> float | None:
    """The % of the copy's rate a row must reach, or None where the issue sets none."""
    if impl == "rms_norm":
        if features == 128:
            return QK
        if 1024 <= features <= WIDEST:
            return FORWARD if kind == "fwd" else BOTH
    if impl == "add_rms_norm" and kind == "fwd+bwd":
        return ADD
    return None


def _kernels(row: dict) -> str:
    return ", ".join(f"{name} {us:.1f} us" for name, us in row.get("kernels") or [])


def bandwidth_rows(ops_rows: list[dict]) -> list[list]:
    """One row per measured shape with a goal: its %, the goal, the verdict, the kernels."""
    out = []
    for r in ops_rows:
        want = goal(r["impl"], r["kind"], r["features"])
        if want is None or r.get("status") != "ok":
            continue
        pct = r.get("pct_of_bound")
        if pct is None:
            verdict = "no rate (a smoke run or a CPU)"
        else:
            verdict = "met" if pct >= want else f"short by {want - pct:.1f} points"
        cells = [f"{r['size_mib']:g}", r["features"], r["dtype"], r["impl"], r["kind"]]
        pct_cell = "" if pct is None else f"{pct:.1f}"
        out.append([*cells, pct_cell, f"{want:g}", verdict, _kernels(r)])
    return out


def kernel_rows(ops_rows: list[dict]) -> list[list]:
    """Where ``"auto"`` (``rms_norm``, ``add_rms_norm``) took a kernel: its time over our XLA
    path's and over tokamax's paths' at the same shape."""
    ok = [r for r in ops_rows if r.get("status") == "ok" and r.get("median_s")]
    at = {(r["impl"], r["kind"], r["size_mib"], r["dtype"], r["features"]): r for r in ok}
    out = []
    for r in ok:
        if r["impl"] not in ("rms_norm", "add_rms_norm") or not r.get("uses_kernel"):
            continue
        shape = (r["kind"], r["size_mib"], r["dtype"], r["features"])
        others = [f"{r['impl']} [xla]"]
        if r["impl"] == "rms_norm":
            others += ["tokamax layer_norm [triton]", "tokamax layer_norm [xla]"]
        for other in others:
            if (peer := at.get((other, *shape))) is None:
                continue
            ratio = r["median_s"] / peer["median_s"]
            verdict = "met" if ratio <= 1 else f"slower by {100 * (ratio - 1):.1f} %"
            cells = [f"{r['size_mib']:g}", r["features"], r["dtype"], r["impl"], r["kind"]]
            out.append([*cells, other, f"{ratio:.3f}", verdict, _kernels(r)])
    return out


def step_rows(sections: dict) -> list[list]:
    """Each train step with ``"auto"`` against the same step on the XLA path alone."""
    out = []
    for (name, config, dtype, _), times in step_times(sections).items():
        for op in ("rms_norm", "add_rms_norm"):
            if op in times and f"{op} [xla]" in times:
                ratio = times[op] / times[f"{op} [xla]"]
                verdict = "met" if ratio <= 1 else f"slower by {100 * (ratio - 1):.1f} %"
                out.append([name, config, dtype, op, f"{ratio:.3f}", verdict])
    return out


def _table(head: str, rows: list[list], align: str) -> str:
    return report.table(head, rows, align) if rows else "(none measured)"


def markdown(results: dict) -> str:
    sections = results["sections"]
    ops = sections["ops"]["results"]
    where = f"{results['device']}, jax {results['jax']}, `{sections['ops']['command']}`"
    if commit := sections["ops"].get("commit"):
        where += f" at {commit}"
    cols = "x MiB | features | dtype | op | kind"
    bandwidth = f"{cols} | % | goal | verdict | kernels (device time)"
    steps = "section | config | dtype | op | ratio | verdict"
    return "\n\n".join(
        [
            f"# Issue 46's goals: {where}",
            "## Bandwidth: % of the copy's rate (forward) or of its byte bound (forward+backward)",
            _table(bandwidth, bandwidth_rows(ops), "rrlllrrll"),
            '## Where "auto" took a kernel: its time over each other path\'s',
            _table(f"{cols} | against | ratio | verdict | kernels", kernel_rows(ops), "rrllllrll"),
            '## Train steps: "auto" over the XLA path alone',
            _table(steps, step_rows(sections), "llllrl"),
        ]
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser("python -m benchmarks.goals", description=__doc__)
    p.add_argument("file", help="a results file (<device>-measured.json)")
    args = p.parse_args(argv)
    print(markdown(json.loads(Path(args.file).read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
