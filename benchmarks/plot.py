"""The ``ops`` section's plot: GB/s against features, a line per norm, the copy's rate as a
line. ``python -m benchmarks ops`` draws ``<device>-measured.png`` beside its report;
``python -m benchmarks.plot REPORT.json`` draws it from a report written elsewhere (the
GPU machine may lack matplotlib)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from . import report


def rate_gbs(row: dict) -> float:
    """The least bytes the program must move (``moves`` x-sizes) over its median, in GB/s."""
    return row["moves"] * row["x_bytes"] / row["median_s"] / 1e9


def curves(rows: list[dict]) -> tuple[dict, dict, dict]:
    """From an ``ops`` section's rows, the norms' curves: ``{(size_mib, kind, dtype): {impl:
    [(features, GB/s)]}}``, the copy's median rate per ``(size_mib, dtype)``, and why each
    norm with no measured row has none (``{impl: "status: note"}``)."""
    panels: dict = {}
    copies: dict = {}
    why: dict = {}
    for r in rows:
        if r["group"] != "norm":
            continue
        if r.get("status") != "ok" or not r.get("median_s"):
            why.setdefault(r["impl"], f"{r.get('status')}: {r.get('note', '')}")
        elif r["impl"] == "copy baseline":
            copies.setdefault((r["size_mib"], r["dtype"]), []).append(rate_gbs(r))
        elif r["role"] != "baseline":
            panel = panels.setdefault((r["size_mib"], r["kind"], r["dtype"]), {})
            panel.setdefault(r["impl"], []).append((r["features"], rate_gbs(r)))
    measured = {impl for panel in panels.values() for impl in panel}
    absent = {impl: text for impl, text in why.items() if impl not in measured}
    return panels, {k: statistics.median(v) for k, v in copies.items()}, absent


def _draw_panel(ax, panel: dict, copy: float | None, styles: dict) -> None:
    for impl, points in panel.items():
        features, gbs = zip(*sorted(points), strict=True)
        ax.plot(features, gbs, marker="o", markersize=3, label=impl, **styles[impl])
    if copy is not None:
        ax.axhline(copy, color="black", lw=1.2, ls=":", label="copy baseline (median)")
    widths = sorted({f for points in panel.values() for f, _ in points})
    ax.set_xscale("log", base=2)
    ax.set_xticks(widths, [str(f) for f in widths], rotation=45, fontsize=7)
    ax.set_xlabel("features")
    ax.set_ylabel("GB/s")
    ax.grid(alpha=0.3)


def plot(section: dict, path, title: str):
    """``path`` (PNG): GB/s against features, one line per norm (ours solid, the peers dashed),
    the copy's rate a dotted line; a panel per x size and kind (rows) and dtype (columns).
    Returns the matplotlib Figure."""
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone

    panels, copy, absent = curves(section["results"])
    rows = sorted({(m, k) for m, k, _ in panels}, key=lambda mk: (mk[0], mk[1] != "fwd"))
    dtypes = list(dict.fromkeys(d for _, _, d in panels))
    roles = {r["impl"]: r["role"] for r in section["results"]}
    impls = list(dict.fromkeys(i for panel in panels.values() for i in panel))
    styles = {
        impl: dict(color=f"C{i % 10}", ls="-" if roles[impl] == "ours" else "--")
        for i, impl in enumerate(impls)
    }
    fig = Figure(
        figsize=(6 * max(1, len(dtypes)), 3.6 * max(1, len(rows)) + 1), layout="constrained"
    )
    axes = fig.subplots(max(1, len(rows)), max(1, len(dtypes)), squeeze=False)
    for i, (mib, kind) in enumerate(rows):
        for j, dtype in enumerate(dtypes):
            _draw_panel(
                axes[i][j], panels.get((mib, kind, dtype), {}), copy.get((mib, dtype)), styles
            )
            axes[i][j].set_title(f"{kind}, {dtype}, x of {mib:g} MiB", fontsize=9)
    pairs = [zip(*ax.get_legend_handles_labels(), strict=True) for ax in axes.flat]
    legend = {label: handle for pair in pairs for handle, label in pair}
    missing = "\n".join(f"not measured: {impl} ({why})"[:150] for impl, why in absent.items())
    if legend:
        kw = dict(loc="outside lower center", ncols=4, fontsize=8, title=missing or None)
        fig.legend(legend.values(), legend.keys(), title_fontsize=7, **kw)
    quick = f"\n{report.SMOKE}" * bool(section.get("quick"))
    fig.suptitle(title + quick, fontsize=10, color="red" if quick else "black")
    fig.savefig(path, dpi=110)
    return fig


def draw(rep: dict, path: Path) -> Path | None:
    """The plot of the report ``path`` holds (``rep``): ``<stem>.png`` beside it, from its
    ``ops`` section. Where matplotlib is missing (the GPU machine may lack it), None, and
    the command that draws it from the JSON elsewhere."""
    png = path.with_suffix(".png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        again = report.command([str(path)], "python -m benchmarks.plot")
        print(f"no plot: matplotlib is not installed here; {again} draws it", flush=True)
        return None
    title = f"{rep['device']}: ops, GB/s (the least bytes moved over the median time)"
    title += " (XLA:CPU wall-clock: the copy is no bound)" * (rep.get("platform") == "cpu")
    plot(rep["sections"]["ops"], png, title)
    print(f"drew {png}", flush=True)
    return png


def main(argv: list[str]) -> None:
    """``python -m benchmarks.plot REPORT.json``: the plot of a device report, beside it."""
    if len(argv) != 1 or not argv[0].endswith(".json"):
        raise SystemExit("usage: python -m benchmarks.plot <device>-measured.json")
    path = Path(argv[0])
    rep = json.loads(path.read_text())
    if "ops" not in rep.get("sections", {}):
        raise SystemExit(f"{path} has no ops section: nothing to plot")
    if draw(rep, path) is None:
        raise SystemExit(1)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
