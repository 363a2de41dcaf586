"""benchmarks/device_bench.py: the --quick run, and its GPU and TPU timers with fakes.

The --quick run uses the default device: XLA:CPU here, CUPTI on a GPU machine (where it
checks the GPU path for real). No timing is asserted. The run checks that every
implementation has its row (measured, or saying why not), that the ratios follow from the
measured times, and the compiled memory of the train step, which is a property of the
program. The GPU timer is checked against a fake ``profiler.measure`` (the shapes it
returns with ``aggregate=False``), the TPU trace reader against fake profile data. Also
here: the test set-up for a machine with one accelerator (conftest.accelerator_platform,
helpers' device selection and skips).
"""

import importlib.util
import json
import math
import statistics
import sys
import types
from pathlib import Path

import conftest
import helpers
import jax
import jax.numpy as jnp
import pytest
from jax.experimental.mosaic.gpu import profiler

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def device_bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "device_bench", ROOT / "benchmarks" / "device_bench.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["device_bench"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def quick_report(device_bench, tmp_path_factory):
    out = tmp_path_factory.mktemp("device_bench")
    return device_bench.main(["--quick", "--out", str(out)]), out


# ---------------------------------------------------------------- the --quick run on CPU


def _platform():
    return "gpu" if jax.devices()[0].platform in ("gpu", "cuda", "rocm") else jax.default_backend()


def test_quick_run_writes_every_file(quick_report):
    report, out = quick_report
    assert report["platform"] == _platform()
    stem = report["stem"]
    assert stem == "cpu-measured" if _platform() == "cpu" else stem.endswith("-measured")
    saved = json.loads((out / f"{stem}.json").read_text())
    assert set(saved["sections"]) == {"ops", "step"}
    assert len(saved["sections"]["ops"]["results"]) == len(report["sections"]["ops"]["results"])
    md = (out / f"{stem}.md").read_text()
    method = {"cpu": "wall-clock", "gpu": "CUPTI"}.get(_platform(), "")
    assert "## Isolated ops" in md and "## Train step" in md and method in md
    assert (out / f"{stem}.png").stat().st_size > 10_000


def test_quick_run_has_every_implementation(device_bench, quick_report):
    report, _ = quick_report
    rows = report["sections"]["ops"]["results"]
    expected = {
        "copy baseline",
        "traffic baseline",
        *device_bench.IMPLEMENTATIONS,
        *device_bench.FUSED,
        "jax Pallas rms_norm",
        "tokamax layer_norm",
        "rms_norm [pallas]",
        "add_rms_norm [pallas]",
    }
    for dtype in ("float32", "bfloat16"):
        at = {(r["impl"], r["kind"]): r for r in rows if r["dtype"] == dtype}
        assert {impl for impl, _ in at} == expected
        on_gpu, on_cpu = _platform() == "gpu", _platform() == "cpu"
        measured = expected - {"tokamax layer_norm"}
        if not on_gpu:
            measured -= {"jax Pallas rms_norm"}
            assert at[("jax Pallas rms_norm", "fwd")]["status"] == "skipped"
            assert "GPU only" in at[("jax Pallas rms_norm", "fwd")]["note"]
        if on_cpu or not device_bench.HAS_IMPLEMENTATION:
            measured -= {"rms_norm [pallas]", "add_rms_norm [pallas]"}
            pallas = at[("rms_norm [pallas]", "fwd+bwd")]
            if not device_bench.HAS_IMPLEMENTATION:
                assert pallas["status"] == "missing"
            else:
                assert pallas["status"] == "skipped" and "interpret" in pallas["note"]
        for impl in measured:
            for kind in ("fwd", "fwd+bwd"):
                if (impl, kind) in at:  # the baselines have one kind each
                    row = at[(impl, kind)]
                    assert row["status"] == "ok", row
                    assert row["median_s"] > 0
                    if on_gpu:  # CUPTI's kernel list, each kernel's time in microseconds
                        assert row["kernels"] and all(us > 0 for _, us in row["kernels"])
        tokamax = at[("tokamax layer_norm", "fwd")]
        if importlib.util.find_spec("tokamax") is None:
            assert tokamax["status"] == "missing" and "not installed" in tokamax["note"]
        else:
            assert tokamax["status"] == "ok"


def test_quick_run_ratios_follow_from_the_times(quick_report):
    report, _ = quick_report
    rows = [r for r in report["sections"]["ops"]["results"] if r["status"] == "ok"]
    for dtype in ("float32", "bfloat16"):
        shape = [r for r in rows if r["dtype"] == dtype]
        copy = next(r for r in shape if r["impl"] == "copy baseline")
        assert copy["pct_of_bound"] == pytest.approx(100.0)
        for r in shape:
            # % of the bound at the measured copy rate: moves * t(copy) / (2 * t).
            assert r["pct_of_bound"] == pytest.approx(
                100 * r["moves"] * copy["median_s"] / (2 * r["median_s"])
            )
            if r["role"] == "baseline":
                continue
            peers = [
                q
                for q in shape
                if q["role"] == "peer" and (q["group"], q["kind"]) == (r["group"], r["kind"])
            ]
            best = min(q["median_s"] for q in peers)
            assert r["vs_best_peer"] == pytest.approx(r["median_s"] / best)
            assert r["best_peer"] in {q["impl"] for q in peers}
            if r["role"] == "peer":
                assert r["vs_best_peer"] >= 1.0
            assert math.isfinite(r["vs_best_peer"]) and r["vs_best_peer"] > 0
        moves = {(r["group"], r["kind"]): r["moves"] for r in shape if r["role"] != "baseline"}
        assert moves == {
            ("norm", "fwd"): 2,
            ("norm", "fwd+bwd"): 5,
            ("add", "fwd"): 4,
            ("add", "fwd+bwd"): 8,
            ("gated", "fwd"): 3,
            ("gated", "fwd+bwd"): 8,
        }


def test_quick_train_step_memory(device_bench, quick_report):
    """The compiled temporaries, a property of the program: the layers under
    jax.checkpoint keeping only the norms' statistics go below the x * scale floor."""
    report, _ = quick_report
    rows = report["sections"]["step"]["results"]
    for mlp, dtype in device_bench.QUICK_STEP_CONFIGS:
        by_norm = {r["norm"]: r for r in rows if (r["mlp"], r["dtype"]) == (mlp, dtype)}
        assert set(by_norm) == set(device_bench.step_norms(_platform()))
        for r in by_norm.values():
            assert r["status"] == "ok" and r["median_s"] > 0 and r["temp_bytes"] > 0
            assert len(r["round_medians_s"]) == 5
            assert r["vs_flax"] == pytest.approx(
                r["median_s"] / by_norm["flax RMSNorm"]["median_s"]
            )
            if _platform() == "cpu":
                assert "peak_bytes" not in r  # XLA:CPU reports no memory_stats()
            else:
                assert r["peak_bytes"] > 0 and r["wall_median_s"] > 0
        remat = by_norm["rms_norm, remat saving rms_norm_stat"]["temp_bytes"]
        floor = by_norm["x * scale (floor)"]["temp_bytes"]
        # XLA:CPU, measured here: 1 MiB against 2-3 MiB. Other compilers: at most.
        assert remat < floor if _platform() == "cpu" else remat <= floor, (mlp, dtype)
        assert remat < by_norm["flax RMSNorm"]["temp_bytes"]


def test_only_one_section_keeps_the_other(device_bench, quick_report, tmp_path):
    report, out = quick_report
    name = f"{report['stem']}.json"
    (tmp_path / name).write_text((out / name).read_text())
    again = device_bench.main(
        ["--quick", "--only", "ops", "--out", str(tmp_path), "--dtypes", "float32"]
    )
    assert again["sections"]["step"] == json.loads(json.dumps(report["sections"]["step"]))
    assert {r["dtype"] for r in again["sections"]["ops"]["results"]} == {"float32"}


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


def test_cupti_timer_sums_each_iteration(device_bench, monkeypatch):
    its = iter(
        [
            [("fusion_a", 0.010), ("fusion_b", 0.030)],  # 40 us
            [("fusion_a", 0.012), ("fusion_b", 0.040)],  # 52 us
            [("fusion_a", 0.009), ("fusion_b", 0.031)],  # 40 us
        ]
    )
    calls = []
    monkeypatch.setattr(profiler, "measure", _fake_measure(its, calls))
    sample = device_bench.CuptiTimer(3).sample(lambda x: x + 1, (jnp.ones(2),))
    assert calls == [3]
    assert sample.seconds == pytest.approx([40e-6, 52e-6, 40e-6])
    assert sample.kernels[1] == [("fusion_a", 0.012), ("fusion_b", 0.040)]


def test_cupti_timer_one_iteration_is_a_flat_list(device_bench, monkeypatch):
    its = iter([[("copy", 0.024)]])
    calls = []
    monkeypatch.setattr(profiler, "measure", _fake_measure(its, calls))
    sample = device_bench.CuptiTimer(1).sample(lambda x: x, (jnp.ones(2),))
    assert sample.seconds == pytest.approx([24e-6]) and sample.kernels == [[("copy", 0.024)]]


def test_cupti_timer_retries_one_iteration_per_call(device_bench, monkeypatch):
    calls = []

    def measure(f, *, aggregate=True, iterations=1):
        calls.append(iterations)
        if iterations > 1:
            raise RuntimeError("Kernel names are not consistent across iterations")
        return lambda *args: (f(*args), [("k", 0.5)])

    monkeypatch.setattr(profiler, "measure", measure)
    sample = device_bench.CuptiTimer(3).sample(lambda x: x, (jnp.ones(2),))
    assert calls == [3, 1, 1, 1] and sample.seconds == pytest.approx([5e-4] * 3)


def test_interleaved_median_and_kernel_list(device_bench, monkeypatch):
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

    got = device_bench.interleaved(
        {n: program(n) for n in ("a", "b", "empty")}, device_bench.CuptiTimer(2), rounds=2
    )
    assert order == ["a", "b", "empty", "a", "b"]  # round 1 drops "empty"
    assert got["a"]["median_s"] == pytest.approx(statistics.median([1, 3, 2, 10]) * 1e-3)
    assert got["a"]["round_medians_s"] == pytest.approx([2e-3, 6e-3])
    assert got["a"]["min_s"] == pytest.approx(1e-3) and got["a"]["max_s"] == pytest.approx(1e-2)
    assert got["a"]["kernels"] in ([("ka", 2000.0)], [("ka", 3000.0)])  # microseconds
    assert got["b"]["median_s"] == pytest.approx(0.9e-3)
    assert got["b"]["kernels"] in ([("kb", 500.0), ("kc", 500.0)], [("kb", 400.0), ("kc", 400.0)])
    assert got["empty"]["status"] == "failed" and "no kernel" in got["empty"]["note"]


# ---------------------------------------------------------------- the TPU timer


def _event(name, ns):
    return types.SimpleNamespace(name=name, duration_ns=ns)


def _profile(planes):
    return types.SimpleNamespace(
        planes=[
            types.SimpleNamespace(
                name=name,
                lines=[types.SimpleNamespace(name=ln, events=ev) for ln, ev in lines.items()],
            )
            for name, lines in planes.items()
        ]
    )


def test_trace_module_times(device_bench):
    profile = _profile(
        {
            "/host:CPU": {"python": [_event("jit_dbp0000", 99)]},
            "/device:TPU:0": {
                "XLA Ops": [_event("fusion.1", 5)],
                "XLA Modules": [
                    _event("jit_dbp0000(123)", 2000),
                    _event("jit_dbp0001(124)", 7000),
                    _event("jit_dbp0000(123)", 4000),
                ],
            },
        }
    )
    modules = {("rms_norm", "fwd"): "jit_dbp0000", ("rms_norm", "fwd+bwd"): "jit_dbp0001"}
    times = device_bench.trace_module_times(profile, modules)
    assert times == {("rms_norm", "fwd"): [2e-6, 4e-6], ("rms_norm", "fwd+bwd"): [7e-6]}
    assert (
        device_bench.trace_module_times(profile, {"a": "jit_dbp0000", "b": "jit_dbp0002"}) is None
    )
    host_only = _profile({"/host:CPU": {"python": []}})
    assert device_bench.trace_module_times(host_only, {"a": "jit_dbp0000"}) is None


def test_module_name_is_the_jitted_name(device_bench):
    """What a trace's XLA Modules events are called: from the compiled program itself."""
    fn = device_bench.named(lambda x: x * 2, "dbp0042")
    compiled = jax.jit(fn).lower(jnp.ones(4)).compile()
    assert device_bench.module_name(compiled) == "jit_dbp0042"
    assert device_bench.module_name(fn) == "jit_dbp0042"


def test_trace_timer_falls_back_to_dispatches_without_a_device_plane(device_bench):
    """A real jax.profiler trace on CPU has no TPU plane: many dispatches per timing."""
    fn = jax.jit(device_bench.named(lambda x: x * 2, "dbp0000"))
    timer = device_bench.TraceTimer(iterations=2, dispatches=3)
    got = timer.round({"dbp0000": (fn, (jnp.ones(8),))})
    assert "3 dispatches per timing" in timer.method and "not device time" in timer.method
    assert len(got["dbp0000"].seconds) == 1 and got["dbp0000"].seconds[0] > 0


def test_device_slug(device_bench):
    def slug(platform, kind):
        return device_bench.device_slug(types.SimpleNamespace(platform=platform, device_kind=kind))

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
