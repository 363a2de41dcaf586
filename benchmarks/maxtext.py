"""``maxtext --target T``: is our norm ever behind MaxText's own inside a MaxText-shaped
model? Each norm, layer mode and remat policy compiled deviceless for ``T``."""

from __future__ import annotations

import dataclasses
import itertools
import json

import jax
import jax.numpy as jnp

from . import estimates, models, peers, report

BATCH, QUICK_BATCH = (4, 1024), (2, 128)


def run(args) -> dict:
    """Writes ``maxtext-<target>-jax<version>.md``, ``.json`` (two jax versions' compilers
    give different programs)."""
    v = jax.__version__
    t, out, stem, head = estimates.begin(args, "maxtext", f"-jax{v}")
    cfg = models.MAXTEXT_QUICK if args.quick else models.MAXTEXT_TABLES
    batch, seq = QUICK_BATCH if args.quick else BATCH
    batch, seq = args.batch or batch, args.seq or seq
    head += (
        f", jax {v}. MaxText-shaped Llama2-style train step (`benchmarks/models.py`: {cfg.layers} "
        f"layers, d {cfg.d}, {cfg.heads} heads of {cfg.head_dim}, MLP {cfg.hidden}, vocab "
        f"{cfg.vocab:,}), batch {batch} x {seq}, loss + grad + AdamW, bfloat16 activations, "
        "float32 weights, one device. `maxtext's own`: MaxText's `RMSNorm` (x_hat rounded to "
        "bfloat16, then times the scale in bfloat16); `rms_norm`: ours on the same parameter "
        "(float32, one rounding). " + estimates.DEVICELESS.format(estimates.unit(t))
    )
    config = dict(dataclasses.asdict(cfg), dtype=jnp.dtype(cfg.dtype).name)
    saved = dict(target=t.name, unit=t.estimate_unit, jax=v, command=args.command, quick=args.quick,
                 config=config, batch=batch, seq=seq, records=[])  # fmt: skip
    for mode, remat, name in itertools.product(args.modes, args.remats, peers.MAXTEXT_NORMS):
        saved["records"].append(estimates.maxtext_step(t, cfg, name, mode, remat, batch, seq)[0])
        estimates.add_ratios(
            saved["records"], peers.MAXTEXT_REFERENCE, ("mode", "remat"), "maxtext"
        )
        print(json.dumps(saved["records"][-1]), flush=True)
        report.write(out, stem, saved, f"{head}\n\n{table(t, saved['records'])}")
    print((out / f"{stem}.md").read_text())
    return saved | dict(out=str(out), stem=stem)


def table(t, records: list[dict]) -> str:
    """Ours over MaxText's per (layers, remat), then every compiled program."""
    num, u = estimates._num(t), t.estimate_unit
    ratio = lambda r, key: report.x(r.get(f"{key}_vs_maxtext"), 3)
    ours = [r for r in records if r["norm"] == "rms_norm" and "temp_bytes_vs_maxtext" in r]
    kernels = lambda r: f"{r['kernels_minus_maxtext']:+d}" if "kernels_minus_maxtext" in r else ""
    keys = ("temp_bytes", "step", "non_matmul")
    summary = [[r["mode"], r["remat"], *(ratio(r, k) for k in keys), kernels(r)] for r in ours]

    def every(r):
        temp = f"{r['temp_bytes'] / 2**20:,.1f}" + ("" if r["fits"] else " (does not fit)")
        cost = [f"{r['kernels']} ({r['matmul_kernels']})", num(r["step"]), num(r["non_matmul"])]
        cost = cost if r["fits"] else [""] * 3
        return [r["mode"], r["remat"], r["norm"], temp, *cost, f"{r['compile_s']:.0f}"]

    head = "layers | remat | temp memory | whole-step estimate | non-matmul estimate "
    head += "| kernels, ours minus MaxText's"
    every_head = f"layers | remat | norm | temp MiB | kernels (matmuls) | step ({u}) "
    every_head += f"| non-matmul ({u}) | compile s"
    summary = report.table(head, summary, "llrrrr")
    every = report.table(every_head, map(every, records), "lllrrrrr")
    ours_over = "Ours over MaxText's norm (below 1: ours needs less)"
    return f"{ours_over}:\n\n{summary}\n\nEvery compiled program:\n\n{every}"
