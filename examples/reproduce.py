"""Measure the numbers that docs/example.md and the README quote about the example, and
write them, with the command, commit, versions and machine, to ``examples/results/``.

    python examples/reproduce.py default --runs 3   # python examples/train_lm.py
    python examples/reproduce.py compare --runs 2   # ... --compare --steps 300 --eval-every 50
    python examples/reproduce.py compile-for        # the large config, deviceless

Each run is the example's own command in a fresh process and a temporary workdir. A
trained loss and a CPU time depend on the machine, the Python (its ``pydoc_data`` corpus
differs between versions) and jax, so each file holds every run, and the docs quote the
range over the committed files (``tests/docs/test_doc_numbers.py`` reads them back). A
deviceless compile depends only on the versions of jax and its compilers: one run.

Writes ``examples/results/<what>-py<X.Y>-jax<version>.json`` (and the last run's plot
beside it, ``.png``); ``--out DIR`` writes there instead.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_lm.py"
RESULTS = ROOT / "examples" / "results"

COMPARE = ["--compare", "--steps", "300", "--eval-every", "50"]
# The large config of docs/example.md: 8 layers of d 2048, 1024 tokens a sequence.
LARGE = [
    "--d-model",
    "2048",
    "--num-heads",
    "16",
    "--num-layers",
    "8",
    "--seq-len",
    "1024",
    "--batch-size",
    "64",
]
COMPILE_FOR = {"tpu-v5e:4x4": "8,2", "h100x8": "4,2"}

# Prints compile_for's report as JSON: the example's own function, in a fresh process
# with JAX_PLATFORMS=cpu (set by train_lm itself when --compile-for is in argv).
_COMPILE_FOR = """
import json, os, sys
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import train_lm  # first: it chooses jax's platforms
from lm.compile_for import compile_for
cfg, args = train_lm.parse_args(sys.argv[2:])
print("REPORT " + json.dumps(compile_for(cfg, args.compile_for)))
"""


def _versions(*dists: str) -> dict[str, str]:
    found = {}
    for dist in dists:
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return found


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _commit() -> str:
    """HEAD, with ``-dirty`` when tracked files differ from it (then the numbers are of
    uncommitted code)."""

    def git(*args):
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()

    head = git("rev-parse", "--short=7", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "rmsnorm_jax", "examples")
    return head + ("-dirty" if dirty else "")


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _run(argv: list[str], env: dict[str, str] | None = None) -> tuple[str, float]:
    """The example's command line in a fresh process: its output and its wall time."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, env=env, cwd=ROOT
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    return done.stdout, wall


def _span(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "max": max(values), "median": statistics.median(values)}


def measure_default(runs: int, plot: Path) -> dict:
    """The default run (600 steps): final validation loss, unigram entropy, wall time of
    the whole command, training time and the median step time. The last run's plot is
    copied to ``plot``."""
    records = []
    for i in range(runs):
        with tempfile.TemporaryDirectory() as work:
            load = _loadavg()
            _, wall = _run([str(EXAMPLE), "--workdir", work, "--no-progress"])
            m = json.loads((Path(work) / "metrics.json").read_text())
            shutil.copyfile(Path(work) / "loss.png", plot)
        steps = m["step_time"][5:]
        records.append(
            {
                "final_val_loss": m["final_eval_loss"],
                "unigram_entropy": m["unigram_entropy"],
                "command_wall_s": wall,
                "train_s": m["wall_time"],
                "median_step_s": statistics.median(steps),
                "devices": m["devices"],
                "platform": m["platform"],
                "loadavg_before": load,
            }
        )
        print(f"default run {i + 1}/{runs}: {records[-1]}", flush=True)
    return {
        "command": "python examples/train_lm.py",
        "runs": records,
        "summary": _summary("default", records),
    }


def measure_compare(runs: int, plot: Path) -> dict:
    """``--compare --steps 300 --eval-every 50``: per norm, the step-time table's row. The
    last run's plot is copied to ``plot``."""
    records = []
    for i in range(runs):
        with tempfile.TemporaryDirectory() as work:
            load = _loadavg()
            _, wall = _run([str(EXAMPLE), *COMPARE, "--workdir", work, "--no-progress"])
            rows = json.loads((Path(work) / "compare.json").read_text())
            shutil.copyfile(Path(work) / "compare.png", plot)
        records.append({"rows": rows, "command_wall_s": wall, "loadavg_before": load})
        print(f"compare run {i + 1}/{runs}: {rows}", flush=True)
    return {
        "command": "python examples/train_lm.py " + " ".join(COMPARE),
        "runs": records,
        "summary": _summary("compare", records),
    }


def _summary(what: str, records: list[dict]) -> dict:
    """min, max and median over the runs of each figure (per norm for ``compare``)."""
    if what == "default":
        keys = ("final_val_loss", "command_wall_s", "train_s", "median_step_s")
        return {k: _span([r[k] for r in records]) for k in keys}
    summary = {}
    for norm in [r["norm"] for r in records[0]["rows"]]:
        rows = [next(r for r in rec["rows"] if r["norm"] == norm) for rec in records]
        summary[norm] = {
            k: _span([r[k] for r in rows])
            for k in ("median_step_ms", "vs_layernorm", "final_val_loss", "wall_time_s")
        }
    return summary


def measure_compile_for() -> dict:
    """The large config compiled for a TPU v5e 4x4 pod and an 8-GPU H100 node."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    reports = {}
    for target, mesh in COMPILE_FOR.items():
        argv = ["--compile-for", target, "--mesh", mesh, *LARGE]
        out, wall = _run(["-c", _COMPILE_FOR, str(EXAMPLE), *argv], env=env)
        report = json.loads(
            next(line for line in out.splitlines() if line.startswith("REPORT "))[7:]
        )
        report.update(
            command="python examples/train_lm.py " + " ".join(argv),
            compile_s=wall,
            state_mib=report["state_bytes_per_device"] / 2**20,
            temp_mib=report["temp_bytes_per_device"] / 2**20,
        )
        reports[target] = report
        print(f"compile-for {target}: {report}", flush=True)
    return {
        "command": "python examples/reproduce.py compile-for",
        "targets": reports,
        "compilers": _versions("libtpu", "jax-cuda12-plugin", "jax-cuda12-pjrt"),
    }


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("default", "compare", "compile-for"))
    parser.add_argument("--runs", type=int, default=3, help="runs of a timed command")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument(
        "--append",
        action="store_true",
        help="keep the runs of the file already there (same Python and jax) and add these",
    )
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    started, commit = time.strftime("%Y-%m-%d %H:%M"), _commit()  # what the runs measure
    load = _loadavg()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    path = out / f"{args.what}-py{python}-jax{metadata.version('jax')}.json"
    if args.what == "default":
        result = measure_default(args.runs, path.with_suffix(".png"))
    elif args.what == "compare":
        result = measure_compare(args.runs, path.with_suffix(".png"))
    else:
        result = measure_compile_for()
    result = {
        "what": args.what,
        "written_by": f"python examples/reproduce.py {args.what}"
        + ("" if args.what == "compile-for" else f" --runs {args.runs}"),
        **result,
        "commit": commit,
        "date": started,
        "python": platform.python_version(),
        "versions": _versions("jax", "jaxlib", "flax", "optax", "orbax-checkpoint"),
        "machine": f"{_cpu_model()}, {os.cpu_count()} cores",
        "loadavg": {"start": load, "end": _loadavg()},
    }
    for run in result.get("runs", []):
        run.update(commit=commit, date=started)
    if args.append and path.exists() and args.what != "compile-for":
        earlier = json.loads(path.read_text())
        for run in earlier["runs"]:  # files written before runs carried their commit
            run.setdefault("commit", earlier["commit"])
            run.setdefault("date", earlier["date"])
        result["runs"] = earlier["runs"] + result["runs"]
        result["summary"] = _summary(args.what, result["runs"])
        result["written_by"] += " --append"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
