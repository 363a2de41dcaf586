"""``gemma``: the Gemma-3-style train step with each norm, blocks unrolled and under ``scan``:
on the device jax sees (time and memory), or with ``--target T`` compiled deviceless."""

from __future__ import annotations

import json
from pathlib import Path

from . import estimates, models, peers, report, step

TITLE = "Gemma-3-style train step"
MODES = estimates.GEMMA_MODES
BATCH, QUICK_BATCH, QUICK_TARGET_BATCH = (8, 1024), (2, 16), (2, 64)


def norms(names: str | None, platform: str | None) -> dict:
    """``--norms``; by default all on a device, all but the floor with ``--target`` (each
    deviceless compile of the full model takes minutes: name it to add it)."""
    every = peers.gemma_norms(platform)
    if names is None:
        return {n: f for n, f in every.items() if platform or n != peers.GEMMA_FLOOR}
    return peers.chosen(every, names)


def programs(mode: str, chosen: dict, smoke: bool, batch: int, seq: int) -> dict:
    """``{norm: (step, inputs)}``: the train step with each norm."""
    cfg, scan = models.SMALL if smoke else models.GEMMA3_270M, mode == "scan"
    inputs = models.gemma_inputs(cfg, scan, batch, seq)
    return {name: (models.gemma_train_step(cfg, f, scan), inputs) for name, f in chosen.items()}


def run(args, platform, timer, section, progress) -> None:
    """On the device jax sees; a CPU runs the 2-block config (a smoke run). A run of the same
    model into the same report keeps the modes it did not measure."""
    smoke = args.quick = args.quick or platform == "cpu"
    cfg, (batch, seq) = (
        models.SMALL if smoke else models.GEMMA3_270M,
        QUICK_BATCH if smoke else BATCH,
    )
    batch, seq = args.batch or batch, args.seq or seq
    name = "SMALL" if smoke else "GEMMA3_270M"
    model = f"`models.{name}` ({cfg.layers} blocks, d {cfg.d}, vocab {cfg.vocab:,})"
    section.update(quick=smoke, model=model, batch=batch, seq=seq)
    earlier = args.earlier or {}
    if all(earlier.get(k) == section[k] for k in ("quick", "model", "batch", "seq")):
        section["results"] = [r for r in earlier["results"] if r["mode"] not in args.modes]
    for mode in args.modes:
        own = ["gemma", "--mode", mode, "--batch", str(batch), "--seq", str(seq)]
        chosen = programs(mode, norms(args.norms, platform), smoke, batch, seq)
        rows = step.measure(chosen, own, platform, timer, args, peers.GEMMA_REFERENCE)
        kept = [r for r in section["results"] if r["mode"] != mode]
        new = [dict(section="gemma", mode=mode, norm=n) | r for n, r in rows.items()]
        section["results"] = sorted(kept + new, key=lambda r: MODES.index(r["mode"]))
        times = ", ".join(f"{n} {report.ms(r.get('median_s'))} ms" for n, r in rows.items())
        progress(f"gemma {mode}: {times}")


def describe(section: dict) -> str:
    return (
        f"{section['model']}; batch {section['batch']} x {section['seq']}, loss + grad + AdamW, "
        "bfloat16 activations, float32 weights. Each mode's norms in their own interleaved "
        f"rounds. {step.PEAK}"
    )


def markdown(section: dict) -> str:
    return step.markdown(section, peers.GEMMA_REFERENCE)


def run_target(args) -> dict:
    """Each norm in each mode compiled for ``--target``: ``gemma-<target>.md``, ``.json``."""
    t, out, stem, head = estimates.begin(args, "gemma")
    cfg = models.SMALL if args.quick else models.GEMMA3_270M
    batch, seq = QUICK_TARGET_BATCH if args.quick else BATCH
    batch, seq, order = args.batch or batch, args.seq or seq, list(peers.gemma_norms(None))
    head += (
        f". Gemma-3-style train step (`benchmarks/models.py`: {cfg.layers} blocks, d {cfg.d}, "
        f"{cfg.heads} query heads / {cfg.kv_heads} KV head of {cfg.head_dim}, MLP {cfg.hidden}, "
        f"vocab {cfg.vocab:,}, window {cfg.window}), batch {batch} x {seq}, loss + grad + AdamW, "
        "bfloat16 activations, float32 weights, one device. "
        + estimates.DEVICELESS.format(estimates.unit(t))
    )
    records = json.loads(Path(args.merge).read_text())["records"] if args.merge else []
    for mode in args.modes:
        for name in norms(args.norms, None):
            record = estimates.gemma_step(t, cfg, name, mode, batch, seq)[0]
            records = [r for r in records if (r["norm"], r["mode"]) != (name, mode)] + [record]
            records.sort(key=lambda r: (MODES.index(r["mode"]), order.index(r["norm"])))
            estimates.add_ratios(records, peers.GEMMA_REFERENCE, ("mode",), "gemma")
            print(json.dumps(record), flush=True)
            saved = dict(
                target=t.name, unit=t.estimate_unit, command=args.command, quick=args.quick
            )
            report.write(out, stem, saved | dict(records=records), f"{head}\n\n{table(t, records)}")
    print((out / f"{stem}.md").read_text())
    return saved | dict(records=records, out=str(out), stem=stem)


def table(t, records: list[dict]) -> str:
    num, u = estimates._num(t), t.estimate_unit

    def cells(r):
        ratio = lambda key: report.x(r.get(f"{key}_vs_gemma"), 3)
        temp = f"{r['temp_bytes'] / 2**20:,.0f}" + ("" if r["fits"] else " (does not fit)")
        cost = [r.get("kernels"), f"{r.get('kernels_minus_gemma', 0):+d}"]
        cost += [num(r.get("step")), ratio("step"), num(r.get("non_matmul")), ratio("non_matmul")]
        return [r["mode"], r["norm"], temp, ratio("temp_bytes"), *(cost if r["fits"] else [""] * 6)]

    head = (
        f"mode | norm | temp MiB | vs gemma's | kernels | minus gemma's | step ({u}) | vs gemma's "
    )
    return report.table(
        head + f"| non-matmul ({u}) | vs gemma's", map(cells, records), "llrrrrrrrr"
    )
