"""``python -m benchmarks``: the command line, where each section writes, the deviceless
``estimates`` section, and the index of the committed results.

No timing and no estimate is asserted (the machine is shared and noisy, and a cost model
is the compiler's); what a program keeps for its backward and its compiled memory and
kernels are properties of the program, so they are checked.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import requires_deviceless

import benchmarks.__main__ as cli
from benchmarks import estimates, peers, report, timing

ROOT = Path(__file__).resolve().parents[2]

SMOKE = "smoke run: not a measurement"


def test_help_says_what_each_section_answers_where_and_where_it_writes():
    text = cli.parser().format_help()
    for section in cli.SECTIONS:
        assert re.search(rf"^ +{section}\s+\S", text, flags=re.M), section
    for where in ("device time", "CPU wall", "estimate", "--target", "deviceless"):
        assert where in text
    for written in ("<device>-measured.md", "gemma-<target>.md", "<target>-summary.md"):
        assert written in text
    assert SMOKE in text and "benchmarks/results" in text


@pytest.mark.parametrize("section", cli.SECTIONS)
def test_each_section_has_its_own_help(section, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main([section, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "--quick" in text and "--out" in text
    assert ("--target" in text) == (section in ("gemma", "estimates", "maxtext"))


def test_the_module_runs_as_a_command():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "usage: python -m benchmarks" in done.stdout


@pytest.mark.parametrize("section", ["ops", "step"])
def test_a_target_on_a_device_section_names_the_estimates_section(section, capsys):
    with pytest.raises(SystemExit):
        cli.main([section, "--target", "h100"])
    assert "python -m benchmarks estimates --target h100" in capsys.readouterr().err


def test_estimates_need_a_target(capsys):
    with pytest.raises(SystemExit):
        cli.main(["estimates", "--quick"])
    assert "--target" in capsys.readouterr().err


def test_quick_runs_never_write_into_the_committed_results(tmp_path):
    results = ROOT / "benchmarks" / "results"
    assert report.output_dir(None, quick=False) == results
    quick, again = report.output_dir(None, quick=True), report.output_dir(None, quick=True)
    try:
        assert quick.is_dir() and results.resolve() not in quick.resolve().parents
        assert quick != again  # a new directory per run
    finally:
        quick.rmdir()
        again.rmdir()
    assert report.output_dir(str(tmp_path), quick=True) == tmp_path


def test_commands_record_no_path_of_the_machine(tmp_path, monkeypatch):
    """An absolute ``--out`` is recorded relative to the working folder, or by its last name
    where it lies outside; a relative one as typed."""
    monkeypatch.chdir(tmp_path)
    inside, outside = str(tmp_path / "out" / "RESULTS"), "/elsewhere/RESULTS"
    assert report.command(["ops", "--out", inside]) == "python -m benchmarks ops --out out/RESULTS"
    assert report.command(["ops", "--out", outside]).endswith("--out RESULTS")
    assert report.command(["gemma", "--norms", "gemma's own"]) == (
        "python -m benchmarks gemma --norms 'gemma'\"'\"'s own'"
    )


ABSOLUTE = re.compile(r"(?<![\w.])/(?:tmp|work|root|home|Users|opt|mnt|var|usr)/|\.venv")


@pytest.mark.parametrize("folder", ["benchmarks/results", "docs/results", "examples/results"])
def test_no_committed_result_holds_a_path_of_a_machine(folder):
    """Results record commands and machines, never a folder of the machine that wrote them."""
    import gzip

    for path in sorted((ROOT / folder).rglob("*")):
        if path.suffix in (".png",) or not path.is_file():
            continue
        raw = path.read_bytes()
        text = (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode(errors="replace")
        found = ABSOLUTE.search(text)
        assert not found, (
            f"{path.relative_to(ROOT)}: {text[max(0, found.start() - 60) : found.end() + 40]!r}"
        )


def test_results_json_holds_one_record_a_line():
    saved = {"sections": {"ops": {"command": "c", "results": [{"a": 1, "b": [1, 2]}, {"a": 2}]}}}
    text = report.dumps(saved)
    assert json.loads(text) == saved
    assert text.splitlines()[5].strip() == '{"a": 1, "b": [1, 2]},' and len(text.splitlines()) == 11


def test_every_committed_result_has_the_command_that_writes_it():
    """benchmarks/results/README.md names every file there, each in a row with the command
    that wrote it (the current one, or the removed script at a named commit)."""
    index = (ROOT / "benchmarks" / "results" / "README.md").read_text()
    rows = [line for line in index.splitlines() if line.startswith("| ")]
    for path in sorted((ROOT / "benchmarks" / "results").iterdir()):
        if path.name == "README.md":
            continue
        row = next((r for r in rows if f"`{path.name}`" in r or f"[{path.name}]" in r), None)
        assert row is not None, f"{path.name} is not in benchmarks/results/README.md"
        assert "python -m benchmarks" in row or "python benchmarks/" in row or "by hand" in row, row


def test_benchmarks_readme_lists_every_section():
    text = (ROOT / "benchmarks" / "README.md").read_text()
    for section in cli.SECTIONS:
        assert f"python -m benchmarks {section}" in text
    modules = ["kernel_sizes", "kernel_table", "peak", "clients_memory", "compare_jax"]
    for module in [*modules, "wins", "goals"]:
        assert f"python -m benchmarks.{module}" in text


LIVE_PEAK = """
import os, shutil, tempfile
dump = tempfile.mkdtemp()
os.environ["XLA_FLAGS"] = f"--xla_dump_to={dump} --xla_dump_hlo_as_text"
import jax, jax.numpy as jnp
from benchmarks import clients_memory
clients_memory.DUMP = dump
block = jax.ShapeDtypeStruct((64, 64), jnp.float32)
for loss in (
    lambda x, y: jnp.sin(x @ y) @ jnp.cos(y @ x),
    lambda x, y: jnp.sin(jnp.sin(jnp.sin(x @ y) @ y) @ y) @ y,
):
    compiled = jax.jit(loss).lower(block, block).compile()
    sizes = compiled.memory_analysis()
    print(clients_memory.live_peak(), sizes.temp_size_in_bytes + sizes.output_size_in_bytes)
shutil.rmtree(dump)
"""


def test_live_peak_counts_the_buffers_live_together_not_all():
    """``--live``'s count on XLA:CPU, against programs whose buffers are known ([64, 64]
    float32 blocks, the arguments aside): in ``sin(x @ y) @ cos(y @ x)`` three are live
    together (the last product's two operands and its result; XLA:CPU writes ``x @ y``
    into the output's space, which a count of the temp allocation alone would miss); in a
    chain of products and sines, an operand and its result, two of the seven it writes."""
    done = subprocess.run(
        [sys.executable, "-c", LIVE_PEAK],
        cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        check=True,
    )
    block = 64 * 64 * 4
    (three, three_held), (chain, chain_held) = [
        map(int, line.split()) for line in done.stdout.split("\n")[:2]
    ]
    assert three == 3 * block and three <= three_held
    assert chain == 2 * block and chain <= chain_held


@pytest.mark.newest
def test_the_mosaic_gpu_sweep_times_each_distinct_plan_once(tmp_path, capsys):
    """``kernel_sizes --backend mosaic_gpu --quick`` on a CPU (the visit's dry run, the
    kernels interpreted): every sizing whose plan differs is a row, timed; one whose plan is
    the data's is named as such, not timed again; each plan recorded."""
    from benchmarks import kernel_sizes
    from rmsnorm_jax.kernels import mosaic_gpu

    if not mosaic_gpu.available():
        assert kernel_sizes.main(["--backend", "mosaic_gpu", "--quick"]) == 2
        assert "jax >= 0.11.2" in capsys.readouterr().out
        return
    argv = ["--backend", "mosaic_gpu", "--quick", "--dtypes", "bfloat16", "--out", str(tmp_path)]
    assert kernel_sizes.main(argv) == 0
    got = json.loads((tmp_path / "kernel-sizes-mosaic_gpu-cpu-256.json").read_text())
    assert got["note"] == "smoke run (--quick): not a measurement"
    rows, plans = got["rows"]["bfloat16 n=256"], got["plans"]["bfloat16 n=256"]
    timed = ["forward data's", "forward forward_chunk=32"]
    timed += ["backward data's", "backward backward_chunk=16"]
    assert sorted(rows) == sorted(["xla fwd", "xla fwd+bwd", *timed])
    assert all(r["median_s"] > 0 for r in rows.values())
    assert plans["forward backward_chunk=16"] == "the plan of forward data's"
    assert plans["backward forward_chunk=32"] == "the plan of backward data's"
    assert "T=8 rows" in plans["forward data's"]
    assert "T=16 rows" in plans["forward forward_chunk=32"]
    fastest = got["fastest"]["bfloat16 n=256"]
    for kind in ("forward", "backward"):
        mine = {k.removeprefix(f"{kind} "): r for k, r in rows.items() if k.startswith(kind)}
        times = {k: r["median_s"] for k, r in mine.items()}
        best = min(times, key=times.get)
        assert fastest[kind] == dict(sizing=best, vs_data=times[best] / times["data's"])


def test_the_sweep_refuses_a_cpu_where_it_would_time_nothing(capsys):
    from benchmarks import kernel_sizes

    assert kernel_sizes.main(["--backend", "triton", "--quick"]) == 2
    assert "--backend mosaic_gpu --quick" in capsys.readouterr().out


def test_a_live_run_stopped_by_sigterm_removes_its_dumps():
    """``clients_memory --live`` dumps hundreds of MB into a folder of its own; ``timeout``
    stops a run with SIGTERM, after which the folder must be gone (it was left before)."""
    code = (
        "import os, signal, sys, time; sys.argv += ['--live']\n"
        "from benchmarks import clients_memory\n"
        "print(clients_memory.DUMP, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)  # fmt: skip
    dump = done.stdout.strip().splitlines()[0]
    assert done.returncode == 128 + 15, done.stderr
    assert dump.startswith(tempfile.gettempdir()) and not os.path.exists(dump)


def test_residual_bytes_are_read_from_shapes():
    """What each backward keeps (``jax.vjp``'s residuals), without computing it: ours x, the
    scale and one float32 per row; flax's RMSNorm float32 copies."""
    import jax.numpy as jnp

    x, other, scale, _ = peers.random_inputs(64, 256, jnp.bfloat16)
    ours = peers.residual_bytes(peers.IMPLEMENTATIONS["rms_norm"], x, scale)
    assert ours == x.nbytes + scale.nbytes + 64 * 4
    assert peers.residual_bytes(peers.IMPLEMENTATIONS["flax RMSNorm"], x, scale) > 5.9 * x.nbytes
    assert peers.residual_bytes(peers.FUSED["add_rms_norm"], x, other, scale) < 1.1 * x.nbytes


# ---------------------------------------------------------------- estimates (deviceless)


@pytest.fixture(scope="module")
def h100_estimates(tmp_path_factory):
    out = tmp_path_factory.mktemp("estimates")
    return cli.main(["estimates", "--quick", "--target", "h100", "--out", str(out)]), out


@requires_deviceless("h100")
def test_quick_estimates_write_every_file_labelled(h100_estimates):
    rep, out = h100_estimates
    for name in ("h100.md", "h100-summary.md", "h100-fused.md"):
        text = (out / name).read_text()
        assert SMOKE in text and "not a hardware timing" in text, name
        assert "python -m benchmarks estimates --quick --target h100" in text
        assert "of bound" not in text  # no bound is measured by a compiler
    saved = json.loads((out / "h100.json").read_text())
    assert saved["quick"] and saved["target"] == "h100" and saved["unit"] == "us"
    assert len(json.loads((out / "h100-fused.json").read_text())) == len(rep["fused"])


@requires_deviceless("h100")
def test_quick_estimates_of_the_ops(h100_estimates):
    rep, _ = h100_estimates
    assert {r["impl"] for r in rep["results"]} == {"baseline", *peers.IMPLEMENTATIONS}
    for r in rep["results"]:
        assert r["fwd"] > 0 and r["fwd_bwd"] > 0 and r["fwd_kernels"] >= 1
    by_name = {(r["impl"], r["dtype"]): r for r in rep["fused"]}
    for dtype in ("float32", "bfloat16"):
        # What the backward keeps: h (add), x and the gate (gated), against the
        # compositions' full-size float32 copies.
        assert by_name[("add_rms_norm", dtype)]["residual_x"] < 1.1
        assert by_name[("gated_rms_norm", dtype)]["residual_x"] < 2.1
        assert by_name[("flax RMSNorm + add", dtype)]["residual_x"] > 2.9
        assert by_name[("flax RMSNorm * silu", dtype)]["residual_x"] > 7.9


@requires_deviceless("h100")
def test_quick_estimates_of_the_train_step(h100_estimates):
    """Compile facts of a small H100 step: every program has the same matmuls (only the
    norm differs), ours keeps less than flax's and has fewer kernels than autodiff's."""
    rep, out = h100_estimates
    by_norm = {r["norm"]: r for r in rep["memory"]}
    assert list(by_norm) == list(estimates.MEMORY_NORMS)
    assert len({r["matmul_kernels"] for r in by_norm.values()}) == 1
    assert by_norm["rms_norm"]["matmul_kernels"] > 0
    assert by_norm["rms_norm"]["temp_bytes"] < by_norm["flax RMSNorm"]["temp_bytes"]
    assert by_norm["rms_norm"]["kernels"] < by_norm["jnp + autodiff"]["kernels"]
    assert {r["norm"] for r in rep["step_cost"]} == {"rms_norm", *peers.NORM_PEERS}
    assert "| swiglu | rms_norm |" in (out / "h100.md").read_text()


@requires_deviceless("a100")
def test_a_target_without_a_cost_model_is_refused():
    with pytest.raises(SystemExit, match="no cost model for a100"):
        cli.main(["estimates", "--quick", "--target", "a100"])


def test_a_train_steps_own_peak_is_measured_in_a_process_of_its_own(capsys):
    """``benchmarks.peak`` builds the one program that ``step`` times and prints its peak
    as JSON (None on a CPU, which reports no memory stats); ``own_peaks`` runs such
    commands in processes of their own and says why one failed."""
    from benchmarks import peak

    assert (
        peak.main(
            ["step", "--mlp", "swiglu", "--dtype", "bfloat16", "--quick", "--norm", "rms_norm"]
        )
        == 0
    )
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(line) == {"peak_bytes", "before_bytes"}
    got = timing.own_peaks(
        {
            "ok": [sys.executable, "-c", "print('{\"peak_bytes\": 7}')"],
            "fails": [sys.executable, "-c", "raise SystemExit('no device')"],
        },
        workers=2,
    )
    assert got["ok"] == {"peak_bytes": 7}
    assert got["fails"].startswith("exit 1: no device")


def test_the_kernel_table_in_the_docs_is_the_committed_run(monkeypatch):
    """docs/kernels.md's kernels-against-XLA table is what ``benchmarks.kernel_table``
    prints from the committed results file it names, and its "auto" columns what the
    functions' own route takes on that device and jax, from the measured wins "auto" reads
    (a win that held for another jax would turn them to "kernels" where it covers)."""
    from benchmarks import kernel_table
    from rmsnorm_jax import kernels
    from rmsnorm_jax.kernels import _measured

    h200 = kernels.Target.gpu("NVIDIA H200")
    quiet = tuple(dataclasses.replace(m, jax=("0.10",)) for m in kernels.MEASURED)
    monkeypatch.setattr(_measured, "MEASURED", quiet)
    assert kernel_table.auto_path("rms_norm", 4096, "bfloat16", 32, h200, "0.10.2") == "kernels"
    assert kernel_table.auto_path("rms_norm", 8192, "bfloat16", 32, h200, "0.10.2") == "XLA"
    assert kernel_table.auto_path("add_rms_norm", 8192, "float32", 256, h200, "0.10.2") == "kernels"
    monkeypatch.undo()

    text = (ROOT / "docs" / "kernels.md").read_text()
    match = re.search(
        r"<!-- kernel-table: python -m benchmarks\.kernel_table (\S+) -->\n(.*?)\n"
        r"<!-- /kernel-table -->",
        text,
        flags=re.S,
    )
    assert match, "docs/kernels.md lost its kernel-table markers"
    assert match.group(2) == kernel_table.table(ROOT / match.group(1))
