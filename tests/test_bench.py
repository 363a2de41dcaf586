"""The benchmark's --quick smoke run: every implementation measured, files written.

No timing is asserted (the machine is shared and noisy); the residual memory is a
property of the program, not of the machine, so it is checked.
"""

import importlib.util
import json
import sys
from pathlib import Path

from helpers import requires_deviceless

ROOT = Path(__file__).resolve().parents[1]


def test_quick_run(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench", ROOT / "benchmarks" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench"] = bench
    spec.loader.exec_module(bench)
    results = bench.main(["--quick", "--out", str(tmp_path)])
    impls = {r["impl"] for r in results}
    assert impls == {"baseline", *bench.IMPLEMENTATIONS}
    assert {(r["features"], r["dtype"]) for r in results} == {
        (f, d) for f in (256, 1024) for d in ("float32", "bfloat16")
    }
    for r in results:
        assert r["fwd_s"] > 0 and r["fwd_bwd_s"] > 0
        if r["impl"] in ("rms_norm", "rms_norm p=0.0625", "RMSNorm module"):
            # x, scale and one float32 per row: just over 1x bytes(x).
            assert 1.0 <= r["residual_x"] < 1.1
        if r["impl"] == "flax RMSNorm":
            assert r["residual_x"] > (2.9 if r["dtype"] == "float32" else 5.9)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["results"]) == len(results)
    assert (tmp_path / "results.png").stat().st_size > 10_000
    assert "| features |" in (tmp_path / "results.md").read_text()


@requires_deviceless("h100")
def test_quick_run_for_an_accelerator(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench", ROOT / "benchmarks" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    report = bench.main(["--quick", "--target", "h100", "--out", str(tmp_path)])
    impls = {r["impl"] for r in report["results"]}
    assert impls == {"baseline", *bench.IMPLEMENTATIONS}
    for r in report["results"]:
        assert r["fwd"] > 0 and r["fwd_bwd"] > 0 and r["fwd_kernels"] >= 1
        assert 0 < r["fwd_of_bound"] and 0 < r["fwd_bwd_of_bound"]
    assert report["memory"][0]["norm"] == "rms_norm"
    summary = (tmp_path / "h100-summary.md").read_text()
    assert "not a hardware timing" in summary and "| features |" in summary


@requires_deviceless("h100")
def test_quick_fused_run_on_cpu_and_h100(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench", ROOT / "benchmarks" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for target in ("cpu", "h100"):
        results = bench.main(["--fused", "--quick", "--target", target, "--out", str(tmp_path)])
        by_name = {(r["impl"], r["dtype"]): r for r in results}
        for dtype in ("float32", "bfloat16"):
            # What the backward keeps, a property of the program: h (add), x and the gate
            # (gated), against the compositions' full-size float32 copies.
            assert by_name[("add_rms_norm", dtype)]["residual_x"] < 1.1
            assert by_name[("gated_rms_norm", dtype)]["residual_x"] < 2.1
            assert by_name[("flax RMSNorm + add", dtype)]["residual_x"] > 2.9
            assert by_name[("flax RMSNorm * silu", dtype)]["residual_x"] > 7.9
    assert (tmp_path / "fused.md").exists() and (tmp_path / "h100-fused.md").exists()


def test_quick_runs_never_write_into_the_committed_results(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench", ROOT / "benchmarks" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = ROOT / "benchmarks" / "results"
    assert bench.output_dir(None, quick=False) == results
    quick, again = bench.output_dir(None, quick=True), bench.output_dir(None, quick=True)
    try:
        assert quick.is_dir() and results.resolve() not in quick.resolve().parents
        assert quick != again  # a new directory per run
    finally:
        quick.rmdir()
        again.rmdir()
    assert bench.output_dir(str(tmp_path), quick=True) == tmp_path


@requires_deviceless("h100")
def test_step_kernels_small_h100_step():
    """``step_kernels.py``: per-norm kernel counts of a compiled train step. Compile facts:
    every program has the same GEMMs (only the norm differs), and ours keeps the least."""
    from helpers import load_benchmark_module

    step_kernels = load_benchmark_module("step_kernels")
    rows = step_kernels.main(["--mlp", "swiglu", "--d", "256", "--tokens", "512"])
    by_norm = {name: r for _, name, r in rows}
    assert set(by_norm) == set(step_kernels.NORMS)
    assert len({r["gemm"] for r in by_norm.values()}) == 1 and by_norm["rms_norm"]["gemm"] > 0
    assert by_norm["rms_norm"]["temp_mib"] < by_norm["flax RMSNorm"]["temp_mib"]
    assert by_norm["rms_norm"]["kernels"] < by_norm["jnp + autodiff"]["kernels"]
