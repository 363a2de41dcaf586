"""``python -m benchmarks ops|step|gemma`` on the device jax sees, and its timers.

The ``--quick`` runs use the default device: XLA:CPU here, CUPTI on a GPU machine (where
they check the GPU path for real). No timing is asserted. The runs check that every
implementation has its row (measured, or saying why not), that the ratios follow from the
measured times, the labels of a smoke run, and the compiled memory of the train step, which
is a property of the program. The GPU timer is checked against a fake ``profiler.measure``
(the shapes it returns with ``aggregate=False``). Also here: the test set-up for a machine
with one accelerator (conftest.accelerator_platform, helpers' device selection and skips).
"""

import importlib.util
import json
import math
import re
import statistics
import types

import conftest
import helpers
import jax
import jax.numpy as jnp
import pytest
from jax.experimental.mosaic.gpu import profiler

import benchmarks.__main__ as cli
from benchmarks import ops, peers, report, step, timing

SMOKE = report.SMOKE
GEMMA_NORMS = ("rms_norm", "gemma's own", peers.GEMMA_FLOOR)


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    """The three device sections' --quick runs, one after another into one report (the
    Gemma step with three of its norms, both modes: the CPU's smoke run)."""
    out = tmp_path_factory.mktemp("device")
    cli.main(["ops", "--quick", "--out", str(out)])
    cli.main(["step", "--quick", "--out", str(out)])
    rep = cli.main(["gemma", "--quick", "--norms", ",".join(GEMMA_NORMS), "--out", str(out)])
    return rep, out


def _platform():
    return "gpu" if jax.devices()[0].platform in ("gpu", "cuda", "rocm") else jax.default_backend()


def _tables(markdown: str) -> list[int]:
    """The line numbers where a markdown table starts."""
    lines = markdown.splitlines()
    return [
        i
        for i, line in enumerate(lines)
        if line.startswith("|") and not lines[i - 1].startswith("|")
    ]


# ---------------------------------------------------------------- the --quick runs


def test_quick_runs_write_one_report_with_every_section(quick_report):
    rep, out = quick_report
    assert rep["platform"] == _platform()
    stem = rep["stem"]
    assert stem == "cpu-measured" if _platform() == "cpu" else stem.endswith("-measured")
    saved = json.loads((out / f"{stem}.json").read_text())
    assert set(saved["sections"]) == {"ops", "step", "gemma"}
    for name, section in saved["sections"].items():
        assert section["quick"] and section["command"].startswith(f"python -m benchmarks {name}")
    md = (out / f"{stem}.md").read_text()
    method = {"cpu": "wall-clock", "gpu": "CUPTI"}.get(_platform(), "")
    for heading in ("## Isolated ops", "## Train step", "## Gemma-3-style train step"):
        assert f"{heading} ({SMOKE})" in md
    assert method in md


def test_every_table_of_a_smoke_run_says_so(quick_report):
    rep, out = quick_report
    lines = (out / f"{rep['stem']}.md").read_text().splitlines()
    starts = _tables("\n".join(lines))
    assert len(starts) == 3  # ops, step, gemma
    for i in starts:
        assert SMOKE in lines[i - 2], lines[i - 2]


def test_smoke_run_shows_no_bound(quick_report):
    """A copy of 0.125 MiB is launch overhead, not a bound: no "% of bound" in a smoke run."""
    rep, out = quick_report
    assert "of bound" not in (out / f"{rep['stem']}.md").read_text()
    assert all(r["pct_of_bound"] is None for r in rep["sections"]["ops"]["results"])


def test_quick_run_has_every_implementation(quick_report):
    """Ours on every path (auto, XLA, each kernel backend), every peer (tokamax's Triton kernel
    and XLA path among them) and the baselines: each measured or saying why not."""
    rows = quick_report[0]["sections"]["ops"]["results"]
    ours = [f"{op} [{p}]" for op in ("rms_norm", "add_rms_norm") for p in peers.PATHS]
    tokamax = ["tokamax layer_norm [triton]", "tokamax layer_norm [xla]"]
    expected = {"copy baseline", "traffic baseline", *peers.IMPLEMENTATIONS, *peers.FUSED}
    expected |= {*ours, *tokamax}
    installed = importlib.util.find_spec("tokamax") is not None
    for dtype in ("float32", "bfloat16"):
        at = {(r["impl"], r["kind"]): r for r in rows if r["dtype"] == dtype}
        assert {impl for impl, _ in at} == expected
        measured = (
            expected
            - set(tokamax)
            - ({"rms_norm [pallas]", "add_rms_norm [pallas]"} if _platform() == "cpu" else set())
        )
        if _platform() == "cpu":
            pallas = at[("rms_norm [pallas]", "fwd+bwd")]
            assert pallas["status"] == "skipped" and "interpret" in pallas["note"]
            assert at[("tokamax layer_norm [triton]", "fwd")]["status"] in ("skipped", "missing")
        for impl in measured:
            for kind in ("fwd", "fwd+bwd"):
                if (impl, kind) in at:  # the baselines have one kind each
                    row = at[(impl, kind)]
                    assert row["status"] == "ok", row
                    assert row["median_s"] > 0
                    if _platform() == "gpu":  # CUPTI's kernel list, each kernel in microseconds
                        assert row["kernels"] and all(us > 0 for _, us in row["kernels"])
        xla = at[("tokamax layer_norm [xla]", "fwd+bwd")]
        if installed:
            assert xla["status"] == "ok" and xla["residual_x"] > 0
        else:
            assert xla["status"] == "missing" and "not installed" in xla["note"]
        # What each backward keeps, a property of the program (bytes(x) units).
        assert 1.0 <= at[("rms_norm", "fwd+bwd")]["residual_x"] < 1.1
        assert at[("flax RMSNorm", "fwd+bwd")]["residual_x"] > (2.9 if dtype == "float32" else 5.9)


def test_quick_run_ratios_follow_from_the_times(quick_report):
    rep, _ = quick_report
    rows = [r for r in rep["sections"]["ops"]["results"] if r["status"] == "ok"]
    for dtype in ("float32", "bfloat16"):
        shape = [r for r in rows if r["dtype"] == dtype]
        for r in shape:
            base = "copy baseline" if r["kind"] == "fwd" else "traffic baseline"
            base_t = next(q["median_s"] for q in shape if q["impl"] == base)
            assert r["vs_baseline"] == pytest.approx(r["median_s"] / base_t)
            if r["role"] == "baseline":
                continue
            peer_rows = [
                q
                for q in shape
                if q["role"] == "peer" and (q["group"], q["kind"]) == (r["group"], r["kind"])
            ]
            best = min(q["median_s"] for q in peer_rows)
            assert r["vs_best_peer"] == pytest.approx(r["median_s"] / best)
            assert r["best_peer"] in {q["impl"] for q in peer_rows}
            if r["role"] == "peer":
                assert r["vs_best_peer"] >= 1.0
            assert math.isfinite(r["vs_best_peer"]) and r["vs_best_peer"] > 0
        moves = {(r["group"], r["kind"]): r["moves"] for r in shape if r["role"] != "baseline"}
        assert moves == peers.MOVES


def _row(impl, kind, seconds, role="ours", group="norm"):
    moves = peers.BASELINE_MOVES.get(impl) or peers.MOVES[(group, kind)]
    return dict(
        impl=impl, kind=kind, group=group, role=role, status="ok", median_s=seconds,
        x_bytes=2**25, size_mib=32, moves=moves,
    )  # fmt: skip


def test_bound_is_at_the_measured_copy_rate_and_above_100_says_why():
    rows = [
        _row("copy baseline", "fwd", 20e-6, "baseline"),
        _row("traffic baseline", "fwd+bwd", 40e-6, "baseline"),
        _row("rms_norm", "fwd", 25e-6),
        _row("rms_norm", "fwd+bwd", 40e-6),  # 5 moves in the time of 4 at the copy rate
        _row("flax RMSNorm", "fwd+bwd", 80e-6, "peer"),
    ]
    ops.add_ratios(rows)
    at = {(r["impl"], r["kind"]): r for r in rows}
    assert at[("copy baseline", "fwd")]["pct_of_bound"] == pytest.approx(100)
    assert at[("rms_norm", "fwd")]["pct_of_bound"] == pytest.approx(80)
    assert at[("rms_norm", "fwd+bwd")]["pct_of_bound"] == pytest.approx(125)
    assert at[("rms_norm", "fwd+bwd")]["vs_best_peer"] == pytest.approx(0.5)
    for r in rows:
        r.update(features=1024, dtype="float32")
    assert at[("rms_norm", "fwd")]["gbs"] == pytest.approx(2 * 2**25 / 25e-6 / 1e9)
    md = ops.markdown({"results": rows})
    assert "125% †" in md and "80%" in md and "80% †" not in md
    assert "† above 100 %" in md and "read x once" in md and "GB/s" in md
    ops.add_ratios(rows, with_bound=False)
    assert all(r["pct_of_bound"] is None for r in rows)
    assert "% of copy" not in ops.markdown({"results": rows})


def test_quick_train_step_memory(quick_report):
    """The compiled temporaries, a property of the program: the layers under
    jax.checkpoint keeping only the norms' statistics go below the x * scale floor."""
    rep, _ = quick_report
    rows = rep["sections"]["step"]["results"]
    for mlp, dtype in step.QUICK_CONFIGS:
        by_norm = {r["norm"]: r for r in rows if (r["mlp"], r["dtype"]) == (mlp, dtype)}
        assert set(by_norm) == set(peers.step_norms(_platform(), smoke=True))
        for r in by_norm.values():
            assert r["status"] == "ok" and r["median_s"] > 0 and r["temp_bytes"] > 0
            assert len(r["round_medians_s"]) == 3
            assert r["reference"] == "flax RMSNorm"
            assert r["vs_reference"] == pytest.approx(
                r["median_s"] / by_norm["flax RMSNorm"]["median_s"]
            )
            if _platform() == "cpu":
                assert "peak_bytes" not in r  # XLA:CPU reports no memory_stats()
            else:
                assert r["peak_bytes"] > 0 and r["wall_median_s"] > 0
        remat = by_norm["rms_norm, remat saving rms_norm_stat"]["temp_bytes"]
        floor = by_norm[peers.STEP_FLOOR]["temp_bytes"]
        # XLA:CPU, measured here: 1 MiB against 2-3 MiB. Other compilers: at most.
        assert remat < floor if _platform() == "cpu" else remat <= floor, (mlp, dtype)
        assert remat < by_norm["flax RMSNorm"]["temp_bytes"]


def test_quick_gemma_step_on_the_device(quick_report):
    """Each norm of the Gemma-3-style step, unrolled and scanned, measured in its mode's
    interleaved rounds, against Gemma's own norm; on a CPU always the 2-block config."""
    rep, _ = quick_report
    section = rep["sections"]["gemma"]
    assert "SMALL" in section["model"] and (section["batch"], section["seq"]) == (2, 16)
    rows = section["results"]
    assert [(r["mode"], r["norm"]) for r in rows] == [
        (mode, norm) for mode in ("unrolled", "scan") for norm in GEMMA_NORMS
    ]
    for mode in ("unrolled", "scan"):
        by_norm = {r["norm"]: r for r in rows if r["mode"] == mode}
        ref = by_norm["gemma's own"]["median_s"]
        for r in by_norm.values():
            assert r["status"] == "ok", r
            assert r["median_s"] > 0 and r["temp_bytes"] > 0 and len(r["round_medians_s"]) == 3
            assert r["vs_reference"] == pytest.approx(r["median_s"] / ref)
            if _platform() != "cpu":
                assert r["peak_bytes"] > 0


def test_gemma_norms_on_a_device():
    """The default norms: every one of the model's, the floor, and ours on each path (the
    pre-norm step's fused add too; a CPU's run is a smoke run of the small model: there the
    kernels run interpreted); a deviceless compile leaves the paths out (a kernel has no
    cost estimate)."""
    paths = ["rms_norm [xla]", "rms_norm [pallas]"]
    for platform in ("cpu", "gpu"):
        assert list(peers.gemma_norms(platform)) == [*peers.GEMMA_NORMS, peers.GEMMA_FLOOR, *paths]
    assert list(peers.gemma_norms(None)) == [*peers.GEMMA_NORMS, peers.GEMMA_FLOOR]
    fused = ["add_rms_norm [xla]", "add_rms_norm [pallas]"]
    assert set(peers.step_norms("gpu")) - set(peers.step_norms("cpu")) == {*paths, *fused}
    assert set(peers.step_norms("cpu", smoke=True)) == set(peers.step_norms("gpu"))


def test_one_section_keeps_the_others(quick_report, tmp_path):
    rep, out = quick_report
    name = f"{rep['stem']}.json"
    (tmp_path / name).write_text((out / name).read_text())
    again = cli.main(["ops", "--quick", "--out", str(tmp_path), "--dtypes", "float32"])
    earlier = json.loads((out / name).read_text())["sections"]
    for kept in ("step", "gemma"):
        assert again["sections"][kept] == earlier[kept]
    assert {r["dtype"] for r in again["sections"]["ops"]["results"]} == {"float32"}


def test_measure_steps_reports_a_failing_program():
    ok = (lambda x: x * 2, (jnp.ones(8),))
    broken = (lambda x: x @ jnp.ones((3, 3)), (jnp.ones(8),))  # fails when traced
    rows = timing.measure_steps(
        {"ok": ok, "broken": broken}, "cpu", timing.WallTimer(), 2, 1, reference="ok"
    )
    assert rows["ok"]["status"] == "ok" and rows["ok"]["vs_reference"] == pytest.approx(1.0)
    assert rows["broken"]["status"] == "failed" and "compile" in rows["broken"]["note"]
    assert re.search(r"TypeError|ValueError", rows["broken"]["note"])


# ---------------------------------------------------------------- the GPU timer (fake CUPTI)


def _fake_measure(kernel_ms, calls):
    """profiler.measure as the installed jax has it: per iteration a list of (name, ms);
    with iterations=1 that list itself, not a list of lists. ``kernel_ms`` yields the
    kernel times of each successive iteration."""

    def measure(f, *, aggregate=True, iterations=1):
        assert aggregate is False
        calls.append(iterations)

        def wrapper(*args):
            timings = [list(next(kernel_ms)) for _ in range(iterations)]
            return f(*args), timings[0] if iterations == 1 else timings

        return wrapper

    return measure


def test_cupti_timer_sums_each_iteration(monkeypatch):
    its = iter(
        [
            [("fusion_a", 0.010), ("fusion_b", 0.030)],  # 40 us
            [("fusion_a", 0.012), ("fusion_b", 0.040)],  # 52 us
            [("fusion_a", 0.009), ("fusion_b", 0.031)],  # 40 us
        ]
    )
    calls = []
    monkeypatch.setattr(profiler, "measure", _fake_measure(its, calls))
    sample = timing.CuptiTimer(3).sample(lambda x: x + 1, (jnp.ones(2),))
    assert calls == [3]
    assert sample.seconds == pytest.approx([40e-6, 52e-6, 40e-6])
    assert sample.kernels[1] == [("fusion_a", 0.012), ("fusion_b", 0.040)]


def test_cupti_timer_one_iteration_is_a_flat_list(monkeypatch):
    its = iter([[("copy", 0.024)]])
    calls = []
    monkeypatch.setattr(profiler, "measure", _fake_measure(its, calls))
    sample = timing.CuptiTimer(1).sample(lambda x: x, (jnp.ones(2),))
    assert sample.seconds == pytest.approx([24e-6]) and sample.kernels == [[("copy", 0.024)]]


def test_cupti_timer_retries_one_iteration_per_call(monkeypatch):
    calls = []

    def measure(f, *, aggregate=True, iterations=1):
        calls.append(iterations)
        if iterations > 1:
            raise RuntimeError("Kernel names are not consistent across iterations")
        return lambda *args: (f(*args), [("k", 0.5)])

    monkeypatch.setattr(profiler, "measure", measure)
    sample = timing.CuptiTimer(3).sample(lambda x: x, (jnp.ones(2),))
    assert calls == [3, 1, 1, 1] and sample.seconds == pytest.approx([5e-4] * 3)


def test_interleaved_median_and_kernel_list(monkeypatch):
    """Two programs, two rounds of two iterations, interleaved; the median over every
    iteration, each round's median, and the kernels of the iteration nearest the median.
    A program with no kernels is reported as failed, not measured."""
    order = []
    times = {
        "a": iter([[("ka", 1.0)], [("ka", 3.0)], [("ka", 2.0)], [("ka", 10.0)]]),
        "b": iter([[("kb", 0.5), ("kc", 0.5)], [("kb", 0.4), ("kc", 0.4)]] * 2),
    }

    def measure(f, *, aggregate=True, iterations=1):
        name = f.__name__
        order.append(name)
        if name == "empty":
            return lambda *args: (f(*args), None)
        return lambda *args: (f(*args), [list(next(times[name])) for _ in range(iterations)])

    monkeypatch.setattr(profiler, "measure", measure)

    def program(name):
        fn = lambda x: x * 2
        fn.__name__ = name
        return fn, (jnp.ones(2),)

    got = timing.interleaved(
        {n: program(n) for n in ("a", "b", "empty")}, timing.CuptiTimer(2), rounds=2
    )
    # Round 1 drops "empty" and starts one program later than round 0.
    assert order == ["a", "b", "empty", "b", "a"]
    assert got["a"]["median_s"] == pytest.approx(statistics.median([1, 3, 2, 10]) * 1e-3)
    assert got["a"]["round_medians_s"] == pytest.approx([2e-3, 6e-3])
    assert got["a"]["min_s"] == pytest.approx(1e-3) and got["a"]["max_s"] == pytest.approx(1e-2)
    assert got["a"]["kernels"] in ([("ka", 2000.0)], [("ka", 3000.0)])  # microseconds
    assert got["b"]["median_s"] == pytest.approx(0.9e-3)
    assert got["b"]["kernels"] in ([("kb", 500.0), ("kc", 500.0)], [("kb", 400.0), ("kc", 400.0)])
    assert got["empty"]["status"] == "failed" and "no kernel" in got["empty"]["note"]


def test_device_slug():
    def slug(platform, kind):
        return report.device_slug(types.SimpleNamespace(platform=platform, device_kind=kind))

    assert slug("gpu", "NVIDIA H100 80GB HBM3") == "h100"
    assert slug("gpu", "NVIDIA A100-SXM4-80GB") == "a100"
    assert slug("tpu", "TPU v5 lite") == "tpu-v5e"
    assert slug("tpu", "TPU v6 lite") == "tpu-v6e"
    assert slug("tpu", "TPU v4") == "tpu-v4"
    assert slug("tpu", "TPU v5p") == "tpu-v5p"
    assert slug("cpu", "cpu") == "cpu"
    assert slug("gpu", "Some New GPU") == "some-new-gpu"


# ---------------------------------------------------------------- one-accelerator set-up


@pytest.mark.parametrize(
    "files, plugins, expected",
    [
        ((), ("jax_plugins.xla_cuda12", "libtpu"), None),  # this machine: compilers only
        (("/dev/nvidiactl", "/dev/nvidia0"), ("jax_plugins.xla_cuda13",), "cuda"),
        (("/dev/nvidiactl", "/dev/nvidia0"), (), None),  # a GPU but CPU-only jax
        (("/dev/vfio/vfio",), ("libtpu",), None),  # the VFIO control node of any host
        (("/dev/vfio/vfio", "/dev/vfio/0"), ("libtpu",), "tpu"),
        (("/dev/accel0",), ("libtpu",), "tpu"),
    ],
)
def test_accelerator_detection(monkeypatch, files, plugins, expected):
    import fnmatch

    monkeypatch.setattr(conftest.os.path, "exists", lambda p: p in files)
    monkeypatch.setattr(conftest.glob, "glob", lambda pat: fnmatch.filter(files, pat))
    monkeypatch.setattr(conftest.shutil, "which", lambda name: None)
    monkeypatch.setattr(conftest, "_plugin_installed", lambda *mods: bool(set(mods) & set(plugins)))
    assert conftest.accelerator_platform() == expected


def test_multi_device_tests_take_the_host_cpus_beside_one_gpu():
    gpu, cpus = ["gpu0"], [f"cpu{i}" for i in range(8)]
    assert helpers.select_devices(8, gpu, cpus) == cpus
    assert helpers.select_devices(1, gpu, cpus) == gpu
    assert helpers.select_devices(8, cpus, []) == cpus
    assert helpers.select_devices(4, [f"tpu{i}" for i in range(8)], cpus) == [
        f"tpu{i}" for i in range(4)
    ]
    assert helpers.select_devices(8, gpu, []) is None  # JAX_PLATFORMS=cuda: skip


def test_deviceless_skip_reasons(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    assert "needs JAX_PLATFORMS=cpu" in helpers.deviceless_skip_reason("h100")
    assert "needs JAX_PLATFORMS=cpu" in helpers.deviceless_skip_reason("tpu-v5e:2x2")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setattr(helpers.importlib.util, "find_spec", lambda name: None)
    assert "libtpu not found" in helpers.deviceless_skip_reason("tpu-v5e")
    assert "jax_plugins.xla_cuda12 not found" in helpers.deviceless_skip_reason("h100x8")
    assert helpers.deviceless_skip_reason("cpu") is None
