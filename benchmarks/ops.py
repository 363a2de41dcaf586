"""``ops``: each norm on its own, forward and forward+backward, against every peer (tokamax
included) and the copy's rate measured in the same rounds; what each backward keeps."""

from __future__ import annotations

import statistics
import time

import jax.numpy as jnp

from . import peers, report, timing

TITLE = "Isolated ops"
SIZES_MIB, QUICK_SIZES_MIB = (32, 256), (0.125,)
FEATURES, QUICK_FEATURES = (128, 256, 1024, 2048, 4096, 5120, 8192, 16384, 32768), (256,)


def shows_bound(platform: str, quick: bool) -> bool:
    """GB/s and % of the copy's rate in full runs on a GPU or TPU only: a copy of 0.125 MiB is
    launch overhead, and XLA:CPU spends most of a copy into a fresh output on page faults,
    which other programs avoid (up to 505 % of its rate was seen): there it is no bound."""
    return not quick and platform != "cpu"


def measure_shape(mib, features, dtype, platform, timer, args) -> list[dict]:
    """Every program of one shape in interleaved rounds: one row per program and kind."""
    rows = max(8, int(mib * 2**20 / (jnp.dtype(dtype).itemsize * features)))
    x, other, scale, dy = peers.random_inputs(rows, features, jnp.dtype(dtype))
    progs = peers.op_programs(platform)
    kinds = [(p, k, fn) for p in progs for k, fn in (("fwd", p.fwd), ("fwd+bwd", p.fwd_bwd))]

    def inputs(p, kind):
        return ((x, scale) if p.group == "norm" else (x, other, scale)) + (dy,) * (kind != "fwd")

    programs = {(p.impl, k): (fn, inputs(p, k)) for p, k, fn in kinds if fn}
    compiled = timing.compile_all(programs, args.compile_workers)
    ok = {k: v for k, v in compiled.items() if not isinstance(v, str)}
    timings, results = timing.interleaved(ok, timer, args.rounds), []
    for p, kind, fn in kinds:
        if p.role == "baseline" and fn is None:
            continue
        moves = peers.BASELINE_MOVES.get(p.impl) or peers.MOVES[(p.group, kind)]
        row = dict(section="ops", impl=p.impl, kind=kind, group=p.group, role=p.role)
        row |= dict(size_mib=mib, features=features, rows=rows, dtype=dtype, x_bytes=x.nbytes)
        row["moves"] = moves
        row |= dict(status=p.status, note=p.note) if fn is None else dict(status="ok")
        if isinstance(value := compiled.get((p.impl, kind)), str):
            row.update(status="failed", note=f"compile: {value}")
        elif value:
            row.update(timings[(p.impl, kind)])
            if p.role == "ours":
                row["kernel_backends"] = timing.kernel_backends(value[0])
                row["uses_kernel"] = bool(row["kernel_backends"])
        if kind == "fwd+bwd" and p.role != "baseline" and row["status"] == "ok":
            row["residual_x"] = peers.residual_bytes(p.fwd, *inputs(p, "fwd")) / x.nbytes
        results.append(row)
    add_ratios(results, with_bound=shows_bound(platform, args.quick))
    return results


def add_ratios(results: list[dict], with_bound: bool = True) -> None:
    """For one shape's rows: the ratios to the baseline and to the best peer of the same op
    and kind; with ``with_bound``, GB/s (the least bytes moved over the time) and
    ``pct_of_bound``, that rate over the copy's measured in the same rounds."""
    ok = [r for r in results if r.get("status") == "ok"]
    base = {r["impl"]: r for r in ok if r["role"] == "baseline"}
    for r in results:
        r.update(vs_best_peer=None, best_peer=None, pct_of_bound=None, vs_baseline=None)
        if r.get("status") != "ok":
            continue
        if with_bound and (copy := base.get("copy baseline")):
            r["gbs"] = r["moves"] * r["x_bytes"] / r["median_s"] / 1e9
            r["copy_gbs"] = copy["moves"] * copy["x_bytes"] / copy["median_s"] / 1e9
            r["pct_of_bound"] = 100 * r["gbs"] / r["copy_gbs"]
        if b := base.get("copy baseline" if r["kind"] == "fwd" else "traffic baseline"):
            r["vs_baseline"] = r["median_s"] / b["median_s"]
        key = (r["group"], r["kind"])
        same = [q for q in ok if q["role"] == "peer" and (q["group"], q["kind"]) == key]
        if same and r["role"] != "baseline":
            best = min(same, key=lambda q: q["median_s"])
            r.update(best_peer=best["impl"], vs_best_peer=r["median_s"] / best["median_s"])


def run(args, platform, timer, section, progress) -> None:
    sizes = report.numbers(args.sizes, QUICK_SIZES_MIB if args.quick else SIZES_MIB, float)
    features = report.numbers(args.features, QUICK_FEATURES if args.quick else FEATURES)
    shapes = [(m, d, f) for m in sizes for d in args.dtypes for f in features]
    start = time.perf_counter()
    for done, (mib, dtype, f) in enumerate(shapes, 1):
        section["results"] += (rows := measure_shape(mib, f, dtype, platform, timer, args))
        rms = {r["kind"]: report.us(r.get("median_s")) for r in rows if r["impl"] == "rms_norm"}
        eta = (time.perf_counter() - start) / done * (len(shapes) - done)
        at = f"shape {done}/{len(shapes)}, done in about {eta:.0f} s"
        progress(f"ops {mib:g} MiB {dtype} {f}: rms_norm {rms['fwd']}, {rms['fwd+bwd']} us; {at}")


def describe(section: dict) -> str:
    return ""


BOUND = (
    " GB/s: the least bytes the program must move (forward 2 x-sizes, forward+backward 5; "
    "`add_rms_norm` 4 and 8; `gated_rms_norm` 3 and 8) over its time; % of copy: that rate over "
    "the copy baseline's in the same rounds. † above 100 %: a forward+backward program that "
    "takes dy as an input can read x once for both (4 moves: up to 125 %), and x can sit partly "
    "in the device's cache."
)


def kernel_note(row: dict) -> str:
    """The note of a row whose program calls a Pallas kernel: which backend's (results written
    before the backends were named say only "Pallas kernel")."""
    names = ", ".join(row.get("kernel_backends") or [])
    return ("Pallas kernel" + f": {names}" * bool(names)) if row.get("uses_kernel") else ""


def markdown(section: dict) -> str:
    """Every program: time, spread, GB/s and % of the copy's rate (full device runs), the
    ratios, the residuals the backward keeps and the kernels."""
    rows, quick = section["results"], section.get("quick", False)
    bound = not quick and any(r.get("pct_of_bound") for r in rows)

    def cells(r):
        ok, pct, us = r.get("status") == "ok", r.get("pct_of_bound"), report.us
        note = kernel_note(r) if ok else f"{r['status']}: {r['note']}"
        gbs = f"{r['gbs']:,.0f}" if r.get("gbs") else ""
        rate = [gbs, "" if pct is None else f"{pct:.0f}%" + " †" * (pct > 100)] * bound
        spread = f"{us(r.get('min_s'))}-{us(r.get('max_s'))}" if ok else ""
        cells = [f"{r['size_mib']:g}", r["features"], r["dtype"], r["kind"], r["impl"]]
        cells += [us(r.get("median_s")), spread, report.x(r.get("vs_best_peer")), *rate]
        cells += [report.x(r.get("vs_baseline")), report.x(r.get("residual_x"))]
        return [*cells, len(r.get("kernels", [])) or "", note]

    head = "x MiB | features | dtype | op | implementation | median us | min-max us | vs best peer "
    head += "| GB/s | % of copy " * bound + "| vs baseline | residuals | kernels | note"
    text = "Residuals: the bytes the backward keeps (`jax.vjp`), in bytes(x)." + BOUND * bound
    table = report.table(head, map(cells, rows), "rrlllrlr" + "rr" * bound + "rrrl")
    return report.caption(quick, text) + "\n\n" + table


# ---------------------------------------------------------------- the plot


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
