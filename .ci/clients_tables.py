"""The client libraries' measured tables, as committed under docs/results/ (issue 33).

``tests``: the differences the client-library tests measure. ``.ci/clients.sh test`` runs
tests/integrations/test_clients_{tunix,equinox,gemma,keras}.py with
``$RMSNORM_JAX_CLIENT_RECORD`` set; each
test appends its numbers there as a JSON line (the ``client_record`` fixture of
tests/conftest.py)::

    python .ci/clients_tables.py tests RECORD.jsonl... > docs/results/clients-tests.md

``memory``: the train-step temp memory of ``.ci/clients_memory.py``'s results file::

    python .ci/clients_tables.py memory docs/results/clients-memory.json \\
        > docs/results/clients-memory.md
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def commit() -> str:
    """The checkout's short commit, as the results files record it."""
    run = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=os.path.dirname(os.path.abspath(__file__)),
        capture_output=True,
        text=True,
    )
    return run.stdout.strip()


def tests(rows: list[dict]) -> str:
    merged: dict[tuple[str, str], dict] = {}
    for row in rows:
        merged.setdefault((row["library"], row["family"]), {}).update(row)
    versions = sorted({f"Python {r['python']} with jax {r['jax']}" for r in merged.values()})
    lines = [
        "# The client libraries' tests: ours against the library's own norm",
        "",
        f"Written by `.ci/clients.sh test` and `python .ci/clients_tables.py tests` at "
        f"{commit()} ({'; '.join(versions)}; XLA:CPU). float32: the largest difference of "
        "the logits (and of every gradient) relative to the largest magnitude of the "
        "unpatched model's; bfloat16: the relative L2 distance of the bfloat16 model's logits "
        "from float32 arithmetic on the same parameters, patched (ours) and not (the "
        "library's).",
        "",
        "| library | family | float32 logits | float32 gradients | bfloat16: ours "
        "| bfloat16: the library's |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for (library, family), r in sorted(merged.items()):
        cells = [
            f"{r[key]:{fmt}}" if key in r else ""
            for key, fmt in (
                ("f32_logits", ".3g"),
                ("f32_gradients", ".3g"),
                ("bf16_ours", ".4g"),
                ("bf16_theirs", ".4g"),
            )
        ]
        lines.append(f"| {library} | {family} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


TARGETS = {"cpu": "XLA:CPU", "h100": "H100", "tpu-v5e:2x2": "TPU v5e"}


def _config(row: dict) -> tuple:
    """What a row of the memory table is: library, model, dtype (a Keras row's is its dtype
    policy), remat, the vocabulary and MLP width where they are not the 32,768 and 2,048 of
    the others, and the public preset whose sizes it has with its batch (``--preset``)."""
    preset = (row["preset"], *row["batch"]) if "preset" in row else None
    return (row["library"], row["model"], row["dtype"], row["remat"], row.get("vocab"),
            row.get("mlp"), preset)  # fmt: skip


def _model(config: tuple) -> str:
    """A row's library and model, with what differs from the others' sizes."""
    library, model, _, _, vocab, mlp, preset = config
    sizes = ([f"vocabulary {vocab:,}"] if vocab else []) + ([f"MLP {mlp:,}"] if mlp else [])
    if preset:  # (name, batch, length): the preset's sizes, the row's own batch
        sizes.append(f"{preset[0]}'s sizes, {preset[1]} x {preset[2]:,} tokens")
    return f"{library} {model}" + (f" ({', '.join(sizes)})" if sizes else "")


def _cell(row: dict | None) -> str:
    """A memory table's cell: ours over theirs and, in parentheses, theirs in MiB."""
    if row is None:
        return "not measured"
    if row["ratio"] is None:  # the compiler refused the step: more than the chip's memory
        return "does not fit"
    return f"{row['ratio']:.3f} ({row['theirs_MiB']:,.0f})"


def memory(saved: dict) -> str:
    rows = [r for r in saved["rows"] if "layers" not in r and "spare_GiB" not in r]
    configs = list(dict.fromkeys(_config(r) for r in rows))
    cell = {(*_config(r), r["target"]): r for r in rows}
    provenance = sorted(
        {f"{r['commit']} (Python {r['python']}, jax {r['jax']})" for r in rows if "commit" in r}
    )
    lines = [
        "# The client libraries' train step: temp memory, ours over the library's own norm",
        "",
        "`temp_size_in_bytes` of `jax.jit(jax.value_and_grad(loss))` compiled with the "
        "library's norm and under its patch, from `docs/results/clients-memory.json` (each row "
        f"there holds its command), written at {', '.join(provenance)}. A cell: ours over "
        "the library's (above 1: ours needs more) and, in parentheses, the library's MiB.",
        "",
        "| library, model | dtype | remat | " + " | ".join(TARGETS.values()) + " |",
        "|---|---|---|" + "---:|" * len(TARGETS),
    ]
    for config in configs:
        cells = []
        for target in TARGETS:
            r = cell.get((*config, target))
            cells.append(_cell(r))
        _, _, dtype, remat, *_ = config
        lines.append(
            f"| {_model(config)} | {dtype} | {remat.lower()} | " + " | ".join(cells) + " |"
        )
    live = [r for r in rows if "theirs_live_MiB" in r]
    if live:
        lines += [
            "",
            "`--live`: beside the temp size, the most bytes live at once in the step's own "
            "buffers, its temporaries and its outputs (the arguments, the same in both, "
            "aside), read from what the target's compiler dumps (each value's live range, "
            "`HloLiveRange`, and its place in the buffer assignment). The outputs count "
            "because the buffer assigner lends an output's space to temporaries until the "
            "output is written: two programs with the same bytes live at once can differ in "
            "temp size by where it put them. On TPU v5e the dumped temp allocation is smaller "
            "than `temp_size_in_bytes`, which holds bytes the dump does not show.",
            "",
            "| library, model | dtype | remat | target | theirs MiB | ours MiB | theirs live MiB "
            "| ours live MiB | ours live / theirs live |",
            "|---|---|---|---|---:|---:|---:|---:|---:|",
        ]
        for r in live:
            lines.append(
                f"| {_model(_config(r))} | {r['dtype']} | {r['remat'].lower()} | "
                f"{TARGETS[r['target']]} | "
                f"{r['theirs_MiB']:,.1f} | {r['ours_MiB']:,.1f} | {r['theirs_live_MiB']:,.1f} | "
                f"{r['ours_live_MiB']:,.1f} | {r['ours_live_MiB'] / r['theirs_live_MiB']:.3f} |"
            )
    direct = [r for r in rows if "direct_MiB" in r]
    if direct:
        lines += [
            "",
            "Issue 45's measurement beside `patch_keras()` (`--direct`): each KerasHub norm "
            "class's `call` replaced by a plain `rms_norm` call, compiled in the same step:",
            "",
            "| library, model | dtype | target | theirs MiB | ours MiB | direct swap MiB | ratio |",
            "|---|---|---|---:|---:|---:|---:|",
        ]
        for r in direct:
            lines.append(
                f"| {_model(_config(r))} | {r['dtype']} | {TARGETS[r['target']]} | "
                f"{r['theirs_MiB']:,.1f} | {r['ours_MiB']:,.1f} | {r['direct_MiB']:,.1f} | "
                f"{r['ratio']:.3f} |"
            )
    peak = [r for r in saved["rows"] if "theirs_peak_MiB" in r]
    if peak:
        lines += [
            "",
            "Beside the temp size, each step's `peak_memory_in_bytes` (`--peak`: arguments, "
            "outputs and temporaries the compiler places together), and with `--spare GIB` the "
            "same step holding an argument of GIB GiB that it never reads: a row that does not "
            "fit is the compiler's refusal, the room that program leaves short of the chip's.",
            "",
            "| library, model | dtype | target | spare GiB | theirs temp MiB | ours temp MiB "
            "| theirs peak MiB | ours peak MiB | ours peak / theirs peak |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in peak:
            mib = [r[k] for k in ("theirs_MiB", "ours_MiB", "theirs_peak_MiB", "ours_peak_MiB")]
            cells = ["does not fit" if m is None else f"{m:,.1f}" for m in mib]
            ratio = f"{mib[3] / mib[2]:.3f}" if None not in mib[2:] else "-"
            lines.append(
                f"| {_model(_config(r))} | {r['dtype']} | {TARGETS[r['target']]} | "
                f"{r.get('spare_GiB', 0):g} | " + " | ".join(cells) + f" | {ratio} |"
            )
    layered = [r for r in saved["rows"] if "buffers_theirs" in r]
    for library in dict.fromkeys(r["library"] for r in layered):  # a table per library
        lines += _buffers([r for r in layered if r["library"] == library])
    return "\n".join(lines) + "\n"


def _buffers(rows: list[dict]) -> list[str]:
    """The rows measured with ``--buffers``: the activation-shaped buffers each program
    writes, per shape."""
    shapes = sorted({s for r in rows for s in r["buffers_theirs"] | r["buffers_ours"]})
    lines = [
        "",
        "By layer count, with the activation-shaped buffers each program writes "
        "(`--buffers`: instructions of the entry computation that write a new "
        "`[batch, length, d]` array, theirs / ours):",
        "",
        "| library, model | dtype | remat | layers | target | theirs MiB | ours MiB | ratio | "
        + " | ".join(shapes)
        + " |",
        "|---|---|---|---:|---|---:|---:|---:|" + "---:|" * len(shapes),
    ]
    for r in rows:
        counts = [
            f"{r['buffers_theirs'].get(s, 0)} / {r['buffers_ours'].get(s, 0)}" for s in shapes
        ]
        lines.append(
            f"| {r['library']} {r['model']} | {r['dtype']} | {r['remat'].lower()} | "
            f"{r.get('layers', 'default')} | {TARGETS.get(r['target'], r['target'])} | "
            f"{r['theirs_MiB']:,.1f} | {r['ours_MiB']:,.1f} | {r['ratio']:.3f} | "
            + " | ".join(counts)
            + " |"
        )
    return lines


def main() -> None:
    kind, paths = sys.argv[1], sys.argv[2:]
    if kind == "tests":
        rows = [json.loads(line) for path in paths for line in open(path) if line.strip()]
        sys.stdout.write(tests(rows))
    elif kind == "memory":
        (path,) = paths
        with open(path) as f:
            sys.stdout.write(memory(json.load(f)))
    else:
        sys.exit(f"usage: {__doc__}")


if __name__ == "__main__":
    main()
