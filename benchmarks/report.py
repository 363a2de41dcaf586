"""What every section writes: where, the command that wrote it, compact JSON, markdown; and
the run of a device section into its device's report."""

from __future__ import annotations

import importlib
import json
import os
import platform
import re
import shlex
import subprocess
import tempfile
import time
from pathlib import Path

SMOKE = "smoke run: not a measurement"
RESULTS_DIR = Path(__file__).parent / "results"


def output_dir(out: str | None, quick: bool) -> Path:
    """``out``; else a new temporary folder for ``--quick`` (never the committed results)."""
    if out is not None:
        return Path(out)
    return Path(tempfile.mkdtemp(prefix="benchmarks-quick-")) if quick else RESULTS_DIR


def command(argv: list[str], prog: str = "python -m benchmarks") -> str:
    """The command line as typed, with no path of this machine: an absolute path becomes
    relative to the working folder, or its last name where it lies outside."""

    def portable(arg: str) -> str:
        rel = os.path.relpath(arg) if os.path.isabs(arg) else arg
        return Path(arg).name if rel.startswith("..") and os.path.isabs(arg) else rel

    return f"{prog} {shlex.join(map(portable, argv))}".strip()


def commit() -> str:
    """The short commit of this checkout ($BENCHMARKS_COMMIT where it has no .git)."""
    if os.environ.get("BENCHMARKS_COMMIT"):
        return os.environ["BENCHMARKS_COMMIT"]
    git = ["git", "rev-parse", "--short", "HEAD"]
    run = subprocess.run(git, cwd=Path(__file__).parent, capture_output=True, text=True)
    return run.stdout.strip()


def cpu_model() -> str:
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    names = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


def machine() -> str:
    import jax

    dev = jax.devices()[0]
    where = f"{jax.device_count()} x {dev.device_kind}"
    where = f"{cpu_model()}, {os.cpu_count()} cores" if dev.platform == "cpu" else where
    return f"{where} ({dev.platform}), jax {jax.__version__}"


def device_slug(device) -> str:
    """``h100``, ``tpu-v5e``, ``cpu``: the name of a device's report."""
    kind = device.device_kind
    if device.platform == "cpu":
        return "cpu"
    if gpu := re.search(r"\b(H100|H200|H20|A100|B200|B100|GB200|L40S|L4|A10G?)\b", kind):
        return gpu.group(1).lower()
    if tpu := re.fullmatch(r"TPU v(\d+)( lite|e|p)?", kind.strip()):
        return f"tpu-v{tpu.group(1)}" + {" lite": "e", "e": "e", "p": "p", None: ""}[tpu.group(2)]
    return re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-") or device.platform


def dumps(obj, indent: str = "") -> str:
    """JSON with one line per record: a dict or list that holds dicts is laid out, anything
    else (a record, a list of numbers) stays on one line."""
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list) else ()
    nested = lambda v: isinstance(v, dict) or (isinstance(v, list) and v and isinstance(v[0], dict))
    if not any(map(nested, values)):
        return json.dumps(obj, default=str)
    inner = indent + " "
    if isinstance(obj, dict):
        items = [f"{inner}{json.dumps(k)}: {dumps(v, inner)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + f"\n{indent}}}"
    return "[\n" + ",\n".join(inner + dumps(v, inner) for v in obj) + f"\n{indent}]"


def _replace(path: Path, text: str) -> None:
    """``path`` holds ``text``: written beside it, then renamed over it, so that a run stopped
    mid-write (a device visit's timeout) leaves the previous file whole."""
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    os.replace(part, path)


def write(out: Path, stem: str, saved, markdown: str) -> None:
    """``<stem>.json`` and ``<stem>.md`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    _replace(out / f"{stem}.json", dumps(saved) + "\n")
    _replace(out / f"{stem}.md", markdown + "\n")


def table(head: str, rows, align: str) -> str:
    """A markdown table: ``head`` is "a | b | ...", a row a list of cells or such a string;
    ``align`` has a letter per column, ``r`` for right-aligned."""
    cells = [r if isinstance(r, str) else " | ".join(map(str, r)) for r in rows]
    sep = "|" + "".join("---:|" if a == "r" else "---|" for a in align)
    return "\n".join([f"| {head} |", sep, *(f"| {c} |" for c in cells)])


def caption(quick: bool, text: str = "") -> str:
    return " ".join([f"**{SMOKE}**"] * quick + [text] * bool(text))


def numbers(value: str | None, default, kind=int) -> list:
    """A comma-separated option as numbers, or ``default``."""
    return [kind(v) for v in value.split(",")] if value else list(default)


def us(s) -> str:
    return "" if s is None else f"{s * 1e6:,.1f}"


def ms(s) -> str:
    return "" if s is None else f"{s * 1e3:,.2f}"


def x(v, digits: int = 2) -> str:
    return "" if v is None else f"{v:.{digits}f}"


def mib(v) -> str:
    return "" if v is None else f"{v / 2**20:,.0f}" if v >= 10 * 2**20 else f"{v / 2**20:.2f}"


# ---------------------------------------------------------------- the device report


def device_markdown(rep: dict) -> str:
    """``<device>-measured.md``: each section's heading, command and rounds, then its tables."""
    lines = [f"# Measured on {rep['device']}", "", f"{rep['machine']}.", ""]
    for name in ("ops", "step", "gemma"):
        if s := rep["sections"].get(name):
            module = importlib.import_module(f"benchmarks.{name}")
            rounds = f"{s['method']}; {s['rounds']} interleaved rounds after a warm-up round"
            rounds += f", {s['iterations']} iterations per round" * bool(s.get("iterations"))
            written = f"Written by `{s['command']}` on {s['machine']}. {module.describe(s)}"
            title = f"## {module.TITLE}" + f" ({SMOKE})" * bool(s.get("quick"))
            lines += [title, "", f"{written}{rounds}; run {s['date']}.", "", module.markdown(s), ""]
    return "\n".join(lines)


def run_device(args, name: str) -> dict:
    """Section ``name`` (ops, step, gemma) on the default device into ``<device>-measured``
    in ``--out``, keeping the other sections of a report already there."""
    import jax

    from . import timing

    device = jax.devices()[0]
    platform, kind = timing.device_platform(device), device.device_kind
    args.rounds = args.rounds or (3 if args.quick else 5)
    # A step is 10-100x an op: 10 iterations make the steps' round medians agree to ~1 %.
    args.iterations = (args.iterations or 10) if platform != "cpu" else None
    args.compile_workers = args.compile_workers or (
        min(8, os.cpu_count()) if args.iterations else 1
    )
    out, stem = output_dir(args.out, args.quick), f"{device_slug(device)}-measured"
    path = out / f"{stem}.json"
    sections = json.loads(path.read_text())["sections"] if path.exists() else {}
    rep = dict(device=f"CPU ({cpu_model()})" if platform == "cpu" else kind, platform=platform)
    rep |= dict(machine=machine(), jax=jax.__version__, sections=sections)
    args.earlier, timer = sections.get(name), timing.make_timer(platform, args.iterations or 1)
    method = timer.method if platform != "cpu" else "CPU " + timer.method
    section = sections[name] = dict(command=args.command, machine=machine(), commit=commit())
    section |= dict(quick=args.quick, date=time.strftime("%Y-%m-%d %H:%M"), rounds=args.rounds)
    section |= dict(iterations=args.iterations, method=method, results=[])
    print(f"{name}: {machine()}; {method}; writing {out / stem}.md/.json", flush=True)
    start = time.perf_counter()

    def progress(text: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {text}", flush=True)
        write(out, stem, rep, device_markdown(rep))

    importlib.import_module(f"benchmarks.{name}").run(args, platform, timer, section, progress)
    print(device_markdown(rep))
    progress(f"wrote {out / stem}.md and .json")
    return rep | dict(out=str(out), stem=stem)
