"""What a run reports: the loss plot, and ``--compare``'s step-time table."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def plot_losses(runs: dict[str, dict], path: Path) -> None:
    """Train and validation loss against step, and validation loss against wall time."""
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone

    fig = Figure(figsize=(11, 4))
    by_step, by_time = fig.subplots(1, 2)
    for name, m in runs.items():
        steps = [e["step"] for e in m["eval"]]
        losses = [e["loss"] for e in m["eval"]]
        line = by_step.plot(steps, losses, "o-", label=f"{name} (val)")[0]
        if len(runs) == 1:
            by_step.plot(
                range(1, len(m["train_loss"]) + 1),
                m["train_loss"],
                alpha=0.4,
                color=line.get_color(),
                label=f"{name} (train)",
            )
        by_time.plot([e["time"] for e in m["eval"]], losses, "o-", label=name)
    first = next(iter(runs.values()))
    entropy = first["unigram_entropy"]
    corpus = first["config"]["data"] or "the pydoc topics corpus"
    for ax in (by_step, by_time):
        ax.axhline(entropy, color="gray", ls="--", label="unigram entropy")
        ax.set_ylabel("loss (nats/byte)")
        ax.legend()
    by_step.set_xlabel("step")
    by_time.set_xlabel("training wall time (s)")
    fig.suptitle(f"byte-level LM on {corpus}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def step_time_table(runs: dict[str, dict]) -> list[dict]:
    """Per norm of ``runs`` (metrics by norm, LayerNorm among them): the median step time
    after 5 warm-up steps, its quartiles, the ratio of medians to LayerNorm's with its
    spread (this norm's quartiles over LayerNorm's, the other way round), the final
    validation loss and the training time."""
    times = {}
    for norm, m in runs.items():
        steps = np.asarray(m["step_time"][5:] or m["step_time"])  # skip compile, warm-up
        times[norm] = 1e3 * np.percentile(steps, [25, 50, 75])
    q1_base, base, q3_base = times["layernorm"]
    return [
        {
            "norm": norm,
            "median_step_ms": float(median),
            "q1_step_ms": float(q1),
            "q3_step_ms": float(q3),
            "vs_layernorm": float(median / base),
            "vs_layernorm_low": float(q1 / q3_base),
            "vs_layernorm_high": float(q3 / q1_base),
            "final_val_loss": m["final_eval_loss"],
            "wall_time_s": m["wall_time"],
        }
        for (norm, m), (q1, median, q3) in zip(runs.items(), times.values(), strict=True)
    ]


def comparison_table(rows: list[dict]) -> str:
    """``step_time_table``'s rows as the Markdown table that ``--compare`` prints."""
    lines = [
        "| norm | median step (ms) | middle half of steps (ms) | vs LayerNorm (spread) "
        "| final val loss | wall (s) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['norm']} | {r['median_step_ms']:.1f} | {r['q1_step_ms']:.1f}-"
            f"{r['q3_step_ms']:.1f} | {r['vs_layernorm']:.3f} ({r['vs_layernorm_low']:.2f}-"
            f"{r['vs_layernorm_high']:.2f}) | {r['final_val_loss']:.3f} | "
            f"{r['wall_time_s']:.1f} |"
        )
    lines += [
        "",
        "Step times after 5 warm-up steps. The norms train one after the other, so a load "
        "that changes between them moves the ratio: the spread runs from the fast quarter "
        "of this norm's steps over LayerNorm's slow quarter to the slow quarter over the "
        "fast one; a spread that includes 1 shows no difference on this machine.",
    ]
    return "\n".join(lines)


def write_comparison(runs: dict[str, dict], workdir: Path) -> None:
    """Prints the table of ``runs`` and writes ``compare.md``, ``compare.json`` and
    ``compare.png`` under ``workdir``."""
    rows = step_time_table(runs)
    table = comparison_table(rows)
    print(table)
    (workdir / "compare.json").write_text(json.dumps(rows, indent=1))
    (workdir / "compare.md").write_text(table + "\n")
    plot_losses(runs, workdir / "compare.png")
