"""device_bench's result files: ``<device>-measured.md``, ``.json`` and ``.png``.

:func:`write_report` writes the report dict (``sections`` ``ops`` and ``step``, each with
its rows) as JSON, as markdown tables (:func:`report_markdown`) and, at the end of a run,
as a plot (:func:`plot`); :func:`device_slug` names the files after the device.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np


def device_slug(device) -> str:
    if device.platform == "cpu":
        return "cpu"
    kind = device.device_kind
    gpu = re.search(r"\b(H100|H200|H20|A100|B200|B100|GB200|L40S|L4|A10G?)\b", kind)
    if gpu:
        return gpu.group(1).lower()
    tpu = re.fullmatch(r"TPU v(\d+)( lite|e|p)?", kind.strip())
    if tpu:
        suffix = {" lite": "e", "e": "e", "p": "p", None: ""}[tpu.group(2)]
        return f"tpu-v{tpu.group(1)}{suffix}"
    return re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-") or device.platform


def _us(seconds) -> str:
    return "" if seconds is None else f"{seconds * 1e6:,.1f}"


def _ms(seconds) -> str:
    return "" if seconds is None else f"{seconds * 1e3:,.2f}"


def _x(value) -> str:
    return "" if value is None else f"{value:.2f}"


def _mib(value) -> str:
    return "" if value is None else f"{value / 2**20:,.0f}"


def ops_markdown(rows: list[dict]) -> str:
    shapes = list(dict.fromkeys((r["size_mib"], r["features"], r["dtype"]) for r in rows))
    out = [
        "### Summary per shape",
        "",
        "Ratios are to the best peer (< 1: faster); % of bound is the least bytes the "
        "program must move over the copy rate measured for the same shape.",
        "",
        "| x MiB | features | dtype | copy us | copy GB/s | rms_norm fwd / copy "
        "| rms_norm fwd+bwd vs best peer (peer) | fwd, fwd+bwd % of bound "
        "| add_rms_norm fwd+bwd vs composition | gated_rms_norm fwd+bwd vs composition |",
        "|---:|---:|---|---:|---:|---:|---|---|---:|---:|",
    ]
    for size, f, dtype in shapes:
        at = {
            (r["impl"], r["kind"]): r
            for r in rows
            if (r["size_mib"], r["features"], r["dtype"]) == (size, f, dtype)
        }
        copy = at.get(("copy baseline", "fwd"), {})
        fwd = at.get(("rms_norm", "fwd"), {})
        fb = at.get(("rms_norm", "fwd+bwd"), {})
        add = at.get(("add_rms_norm", "fwd+bwd"), {})
        gated = at.get(("gated_rms_norm", "fwd+bwd"), {})
        bound = (
            f"{fwd['pct_of_bound']:.0f}%, {fb['pct_of_bound']:.0f}%"
            if fwd.get("pct_of_bound") and fb.get("pct_of_bound")
            else ""
        )
        out.append(
            f"| {size:g} | {f} | {dtype} | {_us(copy.get('median_s'))} "
            f"| {copy.get('copy_gbs', 0):,.0f} | {_x(fwd.get('vs_baseline'))} "
            f"| {_x(fb.get('vs_best_peer'))} ({fb.get('best_peer') or ''}) | {bound} "
            f"| {_x(add.get('vs_best_peer'))} | {_x(gated.get('vs_best_peer'))} |"
        )
    out += [
        "",
        "### Every program",
        "",
        "| x MiB | features | dtype | op | implementation | median us | min-max us "
        "| vs best peer | % of bound | vs baseline | kernels | note |",
        "|---:|---:|---|---|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ok = r.get("status") == "ok"
        spread = f"{_us(r.get('min_s'))}-{_us(r.get('max_s'))}" if ok else ""
        pct = f"{r['pct_of_bound']:.0f}%" if r.get("pct_of_bound") else ""
        note = r.get("note", "") if not ok else ("Pallas kernel" if r.get("uses_kernel") else "")
        if not ok:
            note = f"{r['status']}: {note}"
        out.append(
            f"| {r['size_mib']:g} | {r['features']} | {r['dtype']} | {r['kind']} | {r['impl']} "
            f"| {_us(r.get('median_s'))} | {spread} | {_x(r.get('vs_best_peer'))} | {pct} "
            f"| {_x(r.get('vs_baseline'))} | {len(r.get('kernels', [])) or ''} | {note} |"
        )
    return "\n".join(out)


def step_markdown(rows: list[dict]) -> str:
    out = [
        "| model | mlp | dtype | norm | step ms (median) | min-max ms | wall ms | vs flax "
        "RMSNorm | compiled temp MiB | device peak MiB | note |",
        "|---|---|---|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ok = r.get("status") == "ok" and "median_s" in r
        spread = f"{_ms(r.get('min_s'))}-{_ms(r.get('max_s'))}" if ok else ""
        peak = r.get("peak_bytes")
        peak_text = "" if peak is None else ("" if r.get("peak_is_own") else "<= ") + _mib(peak)
        note = "" if r.get("status") == "ok" else f"{r.get('status')}: {r.get('note', '')}"
        out.append(
            f"| {r['model']} | {r.get('mlp', '')} | {r.get('dtype', '')} | {r['norm']} "
            f"| {_ms(r.get('median_s'))} | {spread} | {_ms(r.get('wall_median_s'))} "
            f"| {_x(r.get('vs_flax'))} | {_mib(r.get('temp_bytes'))} | {peak_text} | {note} |"
        )
    return "\n".join(out)


def report_markdown(report: dict) -> str:
    lines = [
        f"# Measured on {report['device']}",
        "",
        f"{report['machine']}. Written by `benchmarks/device_bench.py` {' '.join(report['argv'])}.",
        "",
    ]
    ops = report["sections"].get("ops")
    if ops:
        lines += [
            "## Isolated ops",
            "",
            f"{ops['method']}; {ops['rounds']} interleaved rounds after a warm-up round"
            + (f", {ops['iterations']} iterations per round" if ops.get("iterations") else "")
            + f"; run {ops['date']}.",
            "",
            ops_markdown(ops["results"]),
            "",
        ]
    step = report["sections"].get("step")
    if step:
        shape = step["shape"]
        lines += [
            "## Train step",
            "",
            f"`prenorm_stack_train_step`: {shape['layers']} layers, d {shape['d']}, "
            f"{shape['tokens']} tokens. {step['method']}; {step['rounds']} interleaved "
            f"rounds after a warm-up round; run {step['date']}. Device peak: "
            f"`peak_bytes_in_use` after the program's first run, each program on its own "
            f"in order of increasing compiled size (the peak cannot be reset: `<=` where it "
            f"did not rise, so the program's own peak is at most that). Wall ms: wall-clock "
            f"per step in separate interleaved rounds (accelerators only).",
            "",
            step_markdown(step["results"]),
            "",
        ]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone

    ops = report["sections"].get("ops", {}).get("results", [])
    step = report["sections"].get("step", {}).get("results", [])
    fig = Figure(figsize=(13, 4.5))
    ax_ops, ax_step = fig.subplots(1, 2)
    ours = ("rms_norm", "add_rms_norm", "gated_rms_norm", "rms_norm [pallas]")
    for impl in ours:
        pts = [
            r for r in ops if r["impl"] == impl and r["kind"] == "fwd+bwd" and r.get("vs_best_peer")
        ]
        if pts:
            labels = [f"{r['size_mib']:g}M {r['features']} {r['dtype'][:4]}" for r in pts]
            ax_ops.plot(labels, [r["vs_best_peer"] for r in pts], "o-", label=impl)
    ax_ops.axhline(1.0, color="gray", lw=1)
    ax_ops.set_ylabel("fwd+bwd time / best peer")
    ax_ops.tick_params(axis="x", labelrotation=90, labelsize=6)
    ax_ops.set_title("isolated ops")
    if ax_ops.has_data():
        ax_ops.legend(fontsize=7)
    groups = list(dict.fromkeys((r["model"], r.get("mlp"), r.get("dtype")) for r in step))
    norms = list(dict.fromkeys(r["norm"] for r in step))
    width = 0.8 / max(1, len(norms))
    for i, norm in enumerate(norms):
        values = [
            next(
                (
                    r.get("vs_flax") or 0
                    for r in step
                    if (r["model"], r.get("mlp"), r.get("dtype")) == g and r["norm"] == norm
                ),
                0,
            )
            for g in groups
        ]
        ax_step.bar(np.arange(len(groups)) + i * width, values, width, label=norm)
    ax_step.axhline(1.0, color="gray", lw=1)
    ax_step.set_xticks(
        np.arange(len(groups)) + 0.4 - width / 2,
        [" ".join(str(p) for p in g if p) for g in groups],
        fontsize=7,
    )
    ax_step.set_ylabel("step time / flax RMSNorm")
    ax_step.set_title("train step")
    if ax_step.has_data():
        ax_step.legend(fontsize=6)
    fig.suptitle(report["device"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_report(report: dict, out: Path, stem: str, with_plot: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str))
    (out / f"{stem}.md").write_text(report_markdown(report))
    if with_plot:
        plot(report, out / f"{stem}.png")
