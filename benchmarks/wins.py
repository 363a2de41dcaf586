"""python -m benchmarks.wins RESULTS.json [--results PATH] [--pallas-backend B] [--commit C]
[--update]: the wins of our kernels over our XLA path that one GPU or TPU run measured, as
entries of ``rmsnorm_jax/kernels/data/measured_wins.json`` (printed; ``--update`` writes
them there in place of the entries for the same op, device kind and jax).

The rule, in this one place (``tests/kernels/test_implementation.py`` checks every
committed win against it):

- ``ops``, forward+backward: at one width and dtype a kernel backend wins where its median
  is below the XLA path's at every size of x the run measured there; of several, the one
  with the least time summed over the sizes.
- The train steps (``step``, ``gemma``): where the run timed a step with an op's kernels
  (``"{op} [pallas]"``: the pre-norm stack's norms or its fused adds, Gemma's norms) that
  was not faster than the same step on the XLA path (``"{op} [xla]"``), the widths it
  normalizes (the pre-norm stack's d; Gemma's d and head_dim) are losses for that op's
  kernels at that step's dtype: ``"auto"`` takes no kernel where a whole train step with
  it was measured no faster.
- A win is a run of consecutive won widths (a loss, or a width where no kernel ran, ends
  it): one entry per op, backend and range, the dtypes with the same range together, x of
  at least the smallest measured inside.

The XLA path is the ``"{op} [xla]"`` row; a run from before those rows had ``"auto"`` on
XLA wherever its own ``"{op}"`` rows used no kernel, and those are read instead. Which
kernels ``"{op} [pallas]"`` ran is its ``kernel_backends``; a run from before that field
needs ``--pallas-backend``, and one from before the sections' ``commit`` needs
``--commit``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "rmsnorm_jax" / "kernels" / "data"
WINS_FILE = DATA / "measured_wins.json"
OPS = ("rms_norm", "add_rms_norm")
BACKENDS = {"Triton": "triton", "Mosaic GPU": "mosaic_gpu", "Mosaic TPU": "mosaic_tpu"}
PLATFORMS = {"gpu": "cuda", "cuda": "cuda", "tpu": "tpu"}
DTYPES = ["float32", "bfloat16", "float16"]
# The widths the Gemma-3-style step normalizes (benchmarks.models.GEMMA3_270M: d, head_dim).
GEMMA_WIDTHS = (640, 256)


def device_kind(device: str) -> str:
    """What a win names of a device: a GPU's model ("H100" of "NVIDIA H100 80GB HBM3"), a
    TPU's whole kind ("TPU v5 lite")."""
    return device.split()[1] if device.startswith("NVIDIA ") else device


def _ok(rows):
    return [r for r in rows if r.get("status") == "ok" and r.get("median_s")]


def _xla_impl(op: str, rows: list[dict]) -> str:
    """The ops rows' name of the XLA path of ``op`` in this run."""
    if any(r["impl"] == f"{op} [xla]" for r in rows):
        return f"{op} [xla]"
    own = [r for r in rows if r["impl"] == op]
    if own and not any(r.get("uses_kernel") for r in own):
        return op
    raise SystemExit(
        f"no XLA path of {op} in this run: no '{op} [xla]' rows, and '{op}' ran kernels"
    )


def _backend(row: dict, pallas_backend: str | None) -> str | None:
    """The kernels a kernel row ran, or None where it ran none (a call the kernels refuse)."""
    if not row.get("uses_kernel"):
        return None
    if row.get("kernel_backends"):
        return BACKENDS[row["kernel_backends"][0]]
    if row["impl"].endswith("[triton]"):
        return "triton"
    if pallas_backend is None:
        raise SystemExit(
            f"'{row['impl']}' ran kernels, and this run predates kernel_backends: say which "
            "backend '[pallas]' took with --pallas-backend"
        )
    return pallas_backend


def op_verdicts(ops_rows: list[dict], op: str, pallas_backend: str | None) -> dict:
    """``{(dtype, features): (backend or None, x_bytes, {backend: (least, most) ratio to
    XLA})}``: the backend that won each measured shape of ``op`` forward+backward (None:
    none did), the smallest x measured there and each backend's time over XLA's."""
    rows = _ok(r for r in ops_rows if r["kind"] == "fwd+bwd")
    if not any(r["impl"] in (f"{op} [pallas]", f"{op} [triton]") for r in rows):
        return {}  # no kernel of op timed
    xla_impl = _xla_impl(op, rows)
    xla = {(r["dtype"], r["features"], r["size_mib"]): r for r in rows if r["impl"] == xla_impl}
    times: dict = defaultdict(lambda: defaultdict(dict))  # shape -> backend -> size -> s
    for r in rows:
        if r["impl"] in (f"{op} [pallas]", f"{op} [triton]"):
            backend = _backend(r, pallas_backend)
            if backend is not None:
                times[r["dtype"], r["features"]][backend][r["size_mib"]] = r["median_s"]
    out = {}
    for (dtype, n), by_backend in times.items():
        sizes = sorted(size for (d, f, size) in xla if (d, f) == (dtype, n))
        ref = {size: xla[dtype, n, size]["median_s"] for size in sizes}
        ratios, winners = {}, {}
        for backend, t in by_backend.items():
            if sorted(t) != sizes:
                continue  # not measured at every size: no verdict
            ratio = [t[s] / ref[s] for s in sizes]
            ratios[backend] = (min(ratio), max(ratio))
            if all(t[s] < ref[s] for s in sizes):
                winners[backend] = sum(t.values())
        best = min(winners, key=winners.get) if winners else None
        x_bytes = min(xla[dtype, n, s]["x_bytes"] for s in sizes)
        out[dtype, n] = (best, x_bytes, ratios)
    return out


def step_times(sections: dict) -> dict[tuple, dict[str, float]]:
    """Each train step a run timed, ``{(section, config, dtype, d): {norm: median_s}}``:
    config the pre-norm stack's MLP or Gemma's mode; Gemma's step has bfloat16 activations
    (benchmarks/gemma.py) and no d."""
    groups: dict = defaultdict(dict)
    for name in ("step", "gemma"):
        for r in (sections.get(name) or {}).get("results", []):
            if r.get("median_s"):
                key = (name, r.get("mlp") or r.get("mode"), r.get("dtype", "bfloat16"), r.get("d"))
                groups[key][r["norm"]] = r["median_s"]
    return groups


def step_losses(sections: dict, op: str) -> dict[str, set[int]]:
    """``{dtype: widths}`` where a train step with ``op``'s kernels (``"{op} [pallas]"``) was
    not faster than the same step on the XLA path (``"{op} [xla]"``; in a run from before
    those rows, ``"{op}"`` where ``"auto"`` ran no kernel in the run's ``ops``)."""
    ops = sections["ops"]["results"]
    auto_was_xla = not any(r.get("uses_kernel") for r in ops if r["impl"] == op)
    losses: dict[str, set[int]] = defaultdict(set)
    kernels = f"{op} [pallas]"
    for (name, _, dtype, d), times in step_times(sections).items():
        xla = f"{op} [xla]" if f"{op} [xla]" in times else op if auto_was_xla else None
        if kernels in times and xla in times and times[kernels] >= times[xla]:
            losses[dtype].update(GEMMA_WIDTHS if name == "gemma" else (d,))
    return losses


def derive(
    results: dict,
    path: str,
    pallas_backend: str | None = None,
    commit: str | None = None,
) -> list[dict]:
    """The wins one results file (``path``, as the entries name it) shows, by the rule
    above, as ``measured_wins.json`` entries."""
    sections = results["sections"]
    ops = sections["ops"]
    commit = commit or ops.get("commit")
    if not commit:
        raise SystemExit("this run predates the sections' commit: pass --commit")
    wins = []
    for op in OPS:
        verdicts = op_verdicts(ops["results"], op, pallas_backend)
        lost = step_losses(sections, op)
        ranges: dict = defaultdict(list)  # (backend, (lo, hi)) -> [(dtype, [(n, verdict)])]
        for dtype in sorted({d for d, _ in verdicts}, key=DTYPES.index):
            widths = sorted({n for d, n in verdicts if d == dtype} | lost.get(dtype, set()))
            run: list = []
            for n in [*widths, None]:
                verdict = verdicts.get((dtype, n))
                won = verdict is not None and verdict[0] and n not in lost.get(dtype, ())
                if won and run and verdict[0] == run[0][1][0]:
                    run.append((n, verdict))
                    continue
                if run:
                    ranges[run[0][1][0], (run[0][0], run[-1][0])].append((dtype, run))
                run = [(n, verdict)] if won else []
        for (backend, features), found in ranges.items():
            wins.append(_entry(op, backend, features, found, results, path, commit))
    return wins


def _entry(op, backend, features, found, results, path, commit) -> dict:
    ops = results["sections"]["ops"]
    ratios = [r for _, run in found for _, v in run for r in v[2][backend]]
    widths = sorted({n for _, run in found for n, _ in run})
    sizes = sorted({r["size_mib"] for r in ops["results"]})
    return dict(
        op=op,
        backend=backend,
        platform=PLATFORMS[results["platform"]],
        device_kind=device_kind(results["device"]),
        dtypes=[dtype for dtype, _ in found],
        features=list(features),
        smallest_bytes=min(v[1] for _, run in found for _, v in run),
        jax=[results["jax"]],
        results=path,
        command=ops["command"].removesuffix(" --out RESULTS"),
        commit=commit,
        measured=(
            f"{min(ratios):.2f}-{max(ratios):.2f}x XLA forward+backward at "
            f"{', '.join(map(str, widths))} features, x of "
            f"{' and '.join(f'{s:g}' for s in sizes)} MiB (python -m benchmarks.wins)"
        ),
    )


def update(wins: list[dict], text: str) -> str:
    """``measured_wins.json``'s text with ``wins`` in place of its entries for the same op,
    device kind and jax."""
    data = json.loads(text)
    new = {(w["op"], w["device_kind"], tuple(w["jax"])) for w in wins}
    kept = [w for w in data["wins"] if (w["op"], w["device_kind"], tuple(w["jax"])) not in new]
    data["wins"] = kept + wins
    return _dumps(data)


def _dumps(data: dict) -> str:
    """``measured_wins.json``'s layout: a field a line, lists inline."""
    wins = [
        "    {\n" + ",\n".join(f"      {json.dumps(k)}: {json.dumps(v)}" for k, v in w.items())
        for w in data["wins"]
    ]
    head = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in data.items() if k != "wins"]
    body = "\n    },\n".join(wins) + "\n    }" if wins else ""
    return "{\n" + ",\n".join([*head, f'  "wins": [\n{body}\n  ]']) + "\n}\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser("python -m benchmarks.wins", description=__doc__)
    p.add_argument("file", help="a results file with an ops section (<device>-measured.json)")
    p.add_argument("--results", help="the path the entries name (default: FILE as given)")
    p.add_argument("--pallas-backend", choices=sorted(set(BACKENDS.values())))
    p.add_argument("--commit", help="the head the run measured, where the file lacks it")
    p.add_argument("--update", action="store_true", help=f"write them into {WINS_FILE.name}")
    args = p.parse_args(argv)
    results = json.loads(Path(args.file).read_text())
    wins = derive(results, args.results or args.file, args.pallas_backend, args.commit)
    if args.update:
        WINS_FILE.write_text(update(wins, WINS_FILE.read_text()))
    json.dump(wins, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
