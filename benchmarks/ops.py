"""``ops``: each norm on its own, forward and forward+backward, against every peer (tokamax
included) and the copy's rate measured in the same rounds; what each backward keeps."""

from __future__ import annotations

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
