"""Device time of the norms on the accelerator jax sees: isolated ops and a whole train step.

    python benchmarks/device_bench.py                # full run (about 8 minutes on an H100)
    python benchmarks/device_bench.py --only ops     # or --only step: one section, merged
                                                     # into the same result files
    python benchmarks/device_bench.py --quick        # tiny shapes (CI, CPU); writes to a
                                                     # temporary directory unless --out

How each program is timed, by the platform of the default device:

- GPU: device time from CUPTI, ``jax.experimental.mosaic.gpu.profiler.measure(compiled,
  aggregate=False, iterations=N)``: per iteration the sum of the program's kernel times;
  the median over every iteration of every round. Each program's kernel list (the
  iteration nearest the median) is kept in the JSON. Never wall-clock for kernels.
- TPU: device time of the program's ``XLA Modules`` events in a ``jax.profiler`` trace of
  each round; where the trace cannot be read, wall-clock over many dispatches per timing
  (labelled so in the results).
- CPU: wall-clock, one call per sample (``bench.time_rounds``): a smoke test of this code.

``--quick``: x of 0.125 MiB with 256 features, 3 rounds; a 2-layer step (d 64, 128
tokens), SwiGLU in bfloat16 and gelu in float32.

Every section interleaves its programs: each once per round, a warm-up round, then
``--rounds`` rounds, so that a program measured first in a fresh process is not favoured
or penalised.

Ops (``--only ops``): forward and forward+backward of ``rms_norm`` (p = 1 and 0.0625), the
``RMSNorm`` Module, ``add_rms_norm`` and ``gated_rms_norm``; their peers: flax RMSNorm,
flax LayerNorm, the plain formula under autodiff, the hand-written flax compositions for
the fused ops; on a GPU jax's Pallas-Triton ``rms_norm``; tokamax's
``layer_norm(..., subtract_mean=False)`` where installed; the fused Pallas kernels
(``implementation="pallas"``) where the installed ``rmsnorm_jax`` has them (not on CPU,
where they run in interpret mode). x of 32 and 256 MiB; 1024, 4096, 5120 and 8192
features; float32 and bfloat16. In the same rounds the copy (``x * 2``) and traffic
(``(x * 2, x * dy)``) baselines. Each result as a ratio to the best peer, and as % of the
bandwidth bound at the copy rate measured for that shape: bytes moved (in units of
bytes(x): forward 2, forward+backward 5; ``add_rms_norm`` 4 and 8, ``gated_rms_norm`` 3
and 8) over the copy's bytes per second.

Train step (``--only step``): ``implementations.prenorm_stack_train_step`` (SwiGLU and
gelu; bfloat16 and float32; 8 layers, d 2048, 16k tokens) with each norm, plus
``rms_norm`` with every layer under ``jax.checkpoint`` saving only ``"rms_norm_stat"``,
and the ``x * scale`` floor. Step time (device time as above, and on an accelerator also
wall-clock per step), the compiled program's temporary memory, and the device's
``peak_bytes_in_use`` where ``memory_stats()`` reports it. The peak cannot be reset: each
program runs once on its own, in order of increasing compiled size, before the timing
rounds, and the process-wide peak after it is recorded; where it rose, it is that
program's own peak (``peak_is_own``), else the program's peak is at most that value.
More models join the section through :data:`EXTRA_STEPS`.

Writes ``<out>/<device>-measured.md``, ``.json`` (rewritten after every shape and every
train-step configuration, so an interrupted run keeps what it measured) and ``.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

import bench
from implementations import (
    EPS,
    FUSED,
    IMPLEMENTATIONS,
    copy_baseline,
    forward_backward,
    fused_forward_backward,
    prenorm_stack_train_step,
    scale_only,
    traffic_baseline,
)

import rmsnorm_jax

SIZES_MIB = (32, 256)
FEATURES = (1024, 4096, 5120, 8192)
DTYPES = ("float32", "bfloat16")
STEP_CONFIGS = tuple((mlp, dtype) for mlp in ("swiglu", "gelu") for dtype in DTYPES)
QUICK_STEP_CONFIGS = (("swiglu", "bfloat16"), ("gelu", "float32"))  # each MLP, each dtype
STEP_SHAPE = dict(layers=8, d=2048, tokens=16384)
QUICK_STEP_SHAPE = dict(layers=2, d=64, tokens=128)

# Bytes each program must move at the least, in units of bytes(x) (FACTS.md's model).
MOVES = {
    ("norm", "fwd"): 2,  # read x, write y
    ("norm", "fwd+bwd"): 5,  # and read x and dy, write dx
    ("add", "fwd"): 4,  # read x and the stream, write y and h
    ("add", "fwd+bwd"): 8,  # and read h and dy, write both input gradients
    ("gated", "fwd"): 3,  # read x and the gate, write y
    ("gated", "fwd+bwd"): 8,  # and read x, the gate and dy, write their gradients
}

HAS_IMPLEMENTATION = "implementation" in inspect.signature(rmsnorm_jax.rms_norm).parameters

StepFactory = Callable[[bool], dict[str, tuple[Callable, tuple]]]

#: More train steps for the step section, by model name. A factory takes ``quick`` and
#: returns ``{norm label: (train_step, args)}``: ``train_step(*args)`` one step of the
#: model with that norm, ``args`` concrete arrays on the default device. The step must
#: not donate its arguments (every program is called many times with the same ones).
#: Each model's programs are measured in their own interleaved rounds and reported
#: beside the pre-norm stack, e.g. for ``benchmarks/gemma.py`` (the lead's few lines)::
#:
#:     import gemma
#:
#:     def gemma_steps(quick):
#:         cfg = gemma.SMALL if quick else gemma.GEMMA3_270M
#:         batch, seq = (2, 16) if quick else (8, 1024)
#:         tokens = jax.random.randint(jax.random.key(0), (batch, seq + 1), 0, cfg.vocab)
#:         params = gemma.init_params(cfg, jax.random.key(1), scan=True)
#:         args = (params, gemma.optimizer().init(params), tokens[:, :-1], tokens[:, 1:])
#:         norms = {"rms_norm": gemma.ours, "flax RMSNorm": gemma.flax_linen,
#:                  "jnp + autodiff": gemma.plain_formula}
#:         return {label: (gemma.train_step(cfg, norm, scan=True), args)
#:                 for label, norm in norms.items()}
#:
#:     EXTRA_STEPS["gemma3 270M"] = gemma_steps
EXTRA_STEPS: dict[str, StepFactory] = {}


# ---------------------------------------------------------------- timers


@dataclasses.dataclass
class Sample:
    """One program's samples from one round: seconds each, and per sample its kernels."""

    seconds: list[float]
    kernels: list[list[tuple[str, float]]] | None = None


def _each(programs: dict, sample: Callable) -> dict:
    """``{name: sample(fn, args)}``, or the exception it raised for that program."""
    out = {}
    for name, (fn, args) in programs.items():
        try:
            out[name] = sample(fn, args)
        except Exception as err:
            out[name] = err
    return out


def _profiler():
    from jax.experimental.mosaic.gpu import profiler

    return profiler


class CuptiTimer:
    """GPU device time: ``profiler.measure(f, aggregate=False, iterations=N)``.

    ``measure`` returns the program's outputs and, per iteration, the list of
    ``(kernel name, milliseconds)`` that CUPTI recorded (a single list, not a list of
    lists, when N is 1; None when no kernel ran). A sample is the sum over one
    iteration's kernels: the device time of the program without launch gaps.
    """

    method = "device time (CUPTI: per-iteration sum of the program's kernel times)"

    def __init__(self, iterations: int):
        self.iterations = iterations

    def sample(self, fn, args) -> Sample:
        try:
            iterations = self._measure(fn, args, self.iterations)
        except RuntimeError as err:
            # measure() refuses a program whose kernels differ between iterations (a
            # one-off kernel, say); then one iteration per call, as many calls.
            if self.iterations == 1 or "iteration" not in str(err):
                raise
            iterations = [it for _ in range(self.iterations) for it in self._measure(fn, args, 1)]
        kernels = [[(str(name), float(ms)) for name, ms in it] for it in iterations]
        return Sample([sum(ms for _, ms in it) * 1e-3 for it in kernels], kernels)

    @staticmethod
    def _measure(fn, args, iterations: int) -> list:
        _, timings = _profiler().measure(fn, aggregate=False, iterations=iterations)(*args)
        if not timings:
            raise RuntimeError("CUPTI recorded no kernel for this program")
        # One iteration: a list of (name, ms); several: a list of such lists.
        return [timings] if isinstance(timings[0], tuple) else timings

    def round(self, programs: dict) -> dict[str, Sample | Exception]:
        return _each(programs, self.sample)


class WallTimer:
    """Wall-clock of one call per sample, interleaved: ``bench.time_rounds``, one round."""

    method = "wall-clock, one call per sample"

    def round(self, programs: dict) -> dict[str, Sample | Exception]:
        try:
            times = bench.time_rounds(programs, repeats=1, warmup=0)
        except Exception:  # find the program that fails
            return _each(
                programs,
                lambda fn, args: Sample(bench.time_rounds({"p": (fn, args)}, 1, warmup=0)["p"]),
            )
        return {name: Sample(t) for name, t in times.items()}


class DispatchTimer:
    """Wall-clock over ``dispatches`` back-to-back calls, divided: amortises the launch."""

    def __init__(self, dispatches: int):
        self.dispatches = dispatches
        self.method = f"wall-clock over {dispatches} dispatches per timing (not device time)"

    def sample(self, fn, args) -> Sample:
        t0 = time.perf_counter()
        jax.block_until_ready([fn(*args) for _ in range(self.dispatches)])
        return Sample([(time.perf_counter() - t0) / self.dispatches])

    def round(self, programs: dict) -> dict[str, Sample | Exception]:
        return _each(programs, self.sample)


def module_name(fn) -> str:
    """The XLA module name of a program: ``jit_<function name>``, as a trace shows it."""
    if hasattr(fn, "as_text"):  # a jax.stages.Compiled
        match = re.search(r"HloModule\s+([\w.-]+)", fn.as_text()[:1000])
        if match:
            return match.group(1)
    return f"jit_{getattr(fn, '__name__', 'program')}"


def trace_module_times(profile, modules: dict, device_prefix: str = "/device:TPU:0"):
    """Device seconds of each program in a ``jax.profiler.ProfileData``, or None.

    ``modules``: ``{program: XLA module name}``. A program's executions are the events
    named after its module (``jit_dbp0007(...)``) on the device plane's ``XLA Modules``
    line. None when the plane, the line or some program's events are missing.
    """
    planes = [p for p in profile.planes if p.name.startswith(device_prefix)]
    if not planes:
        return None
    lines = [line for line in planes[0].lines if line.name == "XLA Modules"]
    if not lines:
        return None
    times: dict = {program: [] for program in modules}
    for event in lines[0].events:
        for program, module in modules.items():
            if event.name.startswith(module):
                times[program].append(event.duration_ns / 1e9)
    if not all(times.values()):
        return None
    return times


class TraceTimer:
    """TPU device time from a ``jax.profiler`` trace of each round (``XLA Modules``).

    Falls back, for the rest of the run, to a :class:`DispatchTimer` when a trace gives
    no device events (``self.method`` says which was used).
    """

    method = "device time (jax.profiler trace, XLA Modules events)"

    def __init__(self, iterations: int, dispatches: int):
        self.iterations = iterations
        self.fallback: DispatchTimer | None = None
        self.dispatches = dispatches

    def round(self, programs: dict) -> dict[str, Sample | Exception]:
        if self.fallback is None:
            times = self._traced(programs)
            if times is not None:
                return {name: Sample(t) for name, t in times.items()}
            self.fallback = DispatchTimer(self.dispatches)
            self.method = self.fallback.method + " (the profiler trace had no device events)"
            print(f"  timing: {self.method}", flush=True)
        return self.fallback.round(programs)

    def _traced(self, programs: dict):
        from jax.profiler import ProfileData

        with tempfile.TemporaryDirectory(prefix="device_bench-trace-") as logdir:
            try:
                with jax.profiler.trace(logdir):
                    for fn, args in programs.values():
                        for _ in range(self.iterations):
                            jax.block_until_ready(fn(*args))
                paths = sorted(Path(logdir).rglob("*.xplane.pb"), key=os.path.getmtime)
                if not paths:
                    return None
                profile = ProfileData.from_file(str(paths[-1]))
            except Exception as err:  # an unreadable trace: fall back, say why
                print(f"  profiler trace not readable: {err!r}", flush=True)
                return None
            return trace_module_times(
                profile, {name: module_name(fn) for name, (fn, _) in programs.items()}
            )


def device_platform(device) -> str:
    """``"gpu"``, ``"tpu"`` or ``"cpu"`` (a CUDA device's ``platform`` reads ``"gpu"``)."""
    return "gpu" if device.platform in ("gpu", "cuda", "rocm") else device.platform


def make_timer(platform: str, iterations: int):
    if platform == "gpu":
        return CuptiTimer(iterations)
    if platform == "tpu":
        return TraceTimer(iterations, dispatches=max(20, iterations))
    return WallTimer()


# ---------------------------------------------------------------- measuring


def summarize(samples: list[float]) -> dict:
    return dict(
        median_s=statistics.median(samples),
        min_s=min(samples),
        max_s=max(samples),
        samples=len(samples),
    )


def median_kernels(samples: list[float], kernels: list[list[tuple[str, float]]]):
    """The kernel list of the sample nearest the median (its sum is a real iteration)."""
    median = statistics.median(samples)
    best = min(range(len(samples)), key=lambda i: abs(samples[i] - median))
    return [(name, round(ms * 1e3, 3)) for name, ms in kernels[best]]


def interleaved(programs: dict, timer, rounds: int, warmup_rounds: int = 1) -> dict[str, dict]:
    """Each program once per round, ``warmup_rounds`` unrecorded, then ``rounds`` rounds.

    ``programs``: ``{name: (callable, args)}``. Returns ``{name: summary}`` with the
    median, min and max over every sample, each round's median (``round_medians_s``), and
    on a GPU the kernel list (name, microseconds) of the sample nearest the median. A
    program that raises is dropped from later rounds and reported with its error.
    """
    programs = dict(programs)
    failed: dict[str, str] = {}
    for _ in range(warmup_rounds):
        for name, (fn, args) in list(programs.items()):
            try:
                jax.block_until_ready(fn(*args))
            except Exception as err:
                failed[name] = _error(err)
                del programs[name]
    seconds: dict[str, list[float]] = {name: [] for name in programs}
    per_round: dict[str, list[float]] = {name: [] for name in programs}
    kernels: dict[str, list] = {name: [] for name in programs}
    for _ in range(rounds):
        for name, sample in timer.round(programs).items():
            if isinstance(sample, Exception):
                failed[name] = _error(sample)
                del programs[name]
                continue
            seconds[name].extend(sample.seconds)
            per_round[name].append(statistics.median(sample.seconds))
            if sample.kernels is not None:
                kernels[name].extend(sample.kernels)
    out = {}
    for name in seconds:
        if name in failed:
            continue
        if not seconds[name]:
            failed[name] = "no samples"
            continue
        out[name] = summarize(seconds[name])
        out[name]["round_medians_s"] = per_round[name]
        if kernels[name]:
            out[name]["kernels"] = median_kernels(seconds[name], kernels[name])
    for name, error in failed.items():
        out[name] = dict(status="failed", note=error)
    return out


def _error(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip().splitlines()
    return text[0][:300] if text else type(err).__name__


def named(fn: Callable, name: str) -> Callable:
    """``fn`` under the function name ``name`` (jit names the program ``jit_<name>``)."""

    def program(*args):
        return fn(*args)

    program.__name__ = program.__qualname__ = name
    return program


def compile_all(programs: dict, workers: int) -> dict:
    """``{name: (fn, args)}`` -> ``{name: (compiled, args) or error string}``.

    Traced and lowered one after another (Python), compiled in ``workers`` threads (XLA
    releases the GIL while it compiles). Each program is jitted under a name of its own,
    ``dbp<NNNN>``, which a TPU trace uses to tell the programs apart.
    """
    lowered, out = {}, {}
    for i, (name, (fn, args)) in enumerate(programs.items()):
        try:
            lowered[name] = (jax.jit(named(fn, f"dbp{i:04d}")).lower(*args), args)
        except Exception as err:
            out[name] = _error(err)

    def compile_one(item):
        name, (low, args) = item
        try:
            return name, (low.compile(), args)
        except Exception as err:
            return name, _error(err)

    if workers > 1 and len(lowered) > 1:
        with ThreadPoolExecutor(workers) as pool:
            out.update(pool.map(compile_one, lowered.items()))
    else:
        out.update(map(compile_one, lowered.items()))
    return {name: out[name] for name in programs}


def uses_custom_kernel(compiled) -> bool:
    """Whether the program calls a Pallas kernel (Triton or Mosaic custom call)."""
    try:
        text = compiled.as_text()
    except Exception:
        return False
    return bool(re.search(r"__gpu\$xla\.gpu\.triton|tpu_custom_call", text))


# ---------------------------------------------------------------- the ops


@dataclasses.dataclass
class OpProgram:
    impl: str
    group: str  # "norm", "add" or "gated"
    role: str  # "ours", "peer" or "baseline"
    fwd: Callable | None  # (x, scale) or (x, other, scale)
    fwd_bwd: Callable | None  # (x, scale, dy) or (x, other, scale, dy)
    note: str = ""  # why there is no program (skipped or missing)
    status: str = "ok"


def _jax_pallas_rms_norm():
    from jax.experimental.pallas.ops.gpu import rms_norm as pallas_ops

    def fn(x, scale):
        # (batch, seq, features), weight and bias; num_warps, num_stages, eps positional
        # (its custom_vjp's non-differentiable arguments).
        x3 = x.reshape(1, *x.shape)
        bias = jnp.zeros_like(scale)
        return pallas_ops.rms_norm(x3, scale, bias, None, 3, EPS).reshape(x.shape)

    return fn


def _tokamax_rms_norm():
    import tokamax

    def fn(x, scale):
        return tokamax.layer_norm(x, scale, None, epsilon=EPS, subtract_mean=False)

    return fn


def op_programs(platform: str) -> list[OpProgram]:
    """Every program of one shape, with the rows that say why a program is absent."""
    progs = [
        OpProgram("copy baseline", "norm", "baseline", copy_baseline, None),
        OpProgram("traffic baseline", "norm", "baseline", None, traffic_baseline),
    ]
    for name, fn in IMPLEMENTATIONS.items():
        role = "peer" if name in ("flax RMSNorm", "flax LayerNorm", "jnp + autodiff") else "ours"
        progs.append(OpProgram(name, "norm", role, fn, forward_backward(fn)))
    if platform == "gpu":
        try:
            fn = _jax_pallas_rms_norm()
            progs.append(OpProgram("jax Pallas rms_norm", "norm", "peer", fn, forward_backward(fn)))
        except ImportError as err:
            progs.append(
                OpProgram("jax Pallas rms_norm", "norm", "peer", None, None, _error(err), "missing")
            )
    else:
        progs.append(
            OpProgram(
                "jax Pallas rms_norm",
                "norm",
                "peer",
                None,
                None,
                "GPU only (Pallas-Triton)",
                "skipped",
            )
        )
    try:
        fn = _tokamax_rms_norm()
        progs.append(OpProgram("tokamax layer_norm", "norm", "peer", fn, forward_backward(fn)))
    except ImportError:
        progs.append(
            OpProgram(
                "tokamax layer_norm",
                "norm",
                "peer",
                None,
                None,
                "tokamax is not installed (optional peer)",
                "missing",
            )
        )
    pallas = {
        "rms_norm [pallas]": (
            "norm",
            lambda x, s: rmsnorm_jax.rms_norm(x, s, EPS, implementation="pallas"),
        ),
        "add_rms_norm [pallas]": (
            "add",
            lambda x, r, s: rmsnorm_jax.add_rms_norm(x, r, s, EPS, implementation="pallas"),
        ),
    }
    for name, fn in FUSED.items():
        group = "add" if "add" in name else "gated"
        role = "ours" if name in ("add_rms_norm", "gated_rms_norm") else "peer"
        progs.append(OpProgram(name, group, role, fn, fused_forward_backward(fn)))
    for name, (group, fn) in pallas.items():
        if not HAS_IMPLEMENTATION:
            why = "rmsnorm_jax has no implementation= argument (no fused kernels)"
            progs.append(OpProgram(name, group, "ours", None, None, why, "missing"))
        elif platform == "cpu":
            why = "CPU runs the kernels in Pallas interpret mode: not a timing"
            progs.append(OpProgram(name, group, "ours", None, None, why, "skipped"))
        else:
            bwd = forward_backward(fn) if group == "norm" else fused_forward_backward(fn)
            progs.append(OpProgram(name, group, "ours", fn, bwd))
    return progs


def op_inputs(rows: int, features: int, dtype):
    kx, ko, ks, kd = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(kx, (rows, features), jnp.float32).astype(dtype)
    other = jax.random.normal(ko, (rows, features), jnp.float32).astype(dtype)
    scale = (1 + 0.1 * jax.random.normal(ks, (features,), jnp.float32)).astype(dtype)
    dy = jax.random.normal(kd, (rows, features), jnp.float32).astype(dtype)
    return x, other, scale, dy


def bench_op_shape(mib: float, features: int, dtype: str, platform: str, timer, args) -> list[dict]:
    """All programs of one shape in interleaved rounds; one result row per program and kind."""
    itemsize = jnp.dtype(dtype).itemsize
    rows = max(8, int(mib * 2**20 / (itemsize * features)))
    x, other, scale, dy = op_inputs(rows, features, jnp.dtype(dtype))
    progs = op_programs(platform)
    programs, absent = {}, []
    for p in progs:
        for kind, fn in (("fwd", p.fwd), ("fwd+bwd", p.fwd_bwd)):
            if p.status != "ok":
                absent.append((p, kind))
            elif fn is not None:
                if p.group == "norm":
                    inputs = (x, scale) if kind == "fwd" else (x, scale, dy)
                else:
                    inputs = (x, other, scale) if kind == "fwd" else (x, other, scale, dy)
                programs[(p.impl, kind)] = (fn, inputs)
    compiled = compile_all(programs, args.compile_workers)
    runnable = {k: v for k, v in compiled.items() if not isinstance(v, str)}
    timings = interleaved(runnable, timer, args.rounds)
    by_impl = {p.impl: p for p in progs}
    results = []
    for key in programs:
        impl, kind = key
        p = by_impl[impl]
        row = dict(
            section="ops",
            impl=impl,
            kind=kind,
            group=p.group,
            role=p.role,
            size_mib=mib,
            features=features,
            rows=rows,
            dtype=dtype,
            x_bytes=x.nbytes,
            method=timer.method,
        )
        if isinstance(compiled[key], str):
            row.update(status="failed", note=f"compile: {compiled[key]}")
        else:
            row["status"] = "ok"
            row.update(timings[key])
            if impl in ("rms_norm", "add_rms_norm", "rms_norm [pallas]", "add_rms_norm [pallas]"):
                row["uses_kernel"] = uses_custom_kernel(compiled[key][0])
        results.append(row)
    for p, kind in absent:
        results.append(
            dict(
                section="ops",
                impl=p.impl,
                kind=kind,
                group=p.group,
                role=p.role,
                size_mib=mib,
                features=features,
                rows=rows,
                dtype=dtype,
                x_bytes=x.nbytes,
                status=p.status,
                note=p.note,
            )
        )
    add_op_ratios(results)
    return results


def add_op_ratios(results: list[dict]) -> None:
    """Ratio to the best peer and % of the bound at the copy rate, for one shape's rows."""
    ok = [r for r in results if r.get("status") == "ok"]
    copy = next((r for r in ok if r["impl"] == "copy baseline"), None)
    traffic = next((r for r in ok if r["impl"] == "traffic baseline"), None)
    for r in results:
        r.update(vs_best_peer=None, best_peer=None, pct_of_bound=None, vs_baseline=None)
        if r.get("status") != "ok":
            continue
        moves = 2 if r["impl"] == "copy baseline" else MOVES.get((r["group"], r["kind"]))
        if r["impl"] == "traffic baseline":
            moves = MOVES[("norm", "fwd+bwd")]
        r["moves"] = moves
        if copy is not None:
            r["copy_gbs"] = 2 * r["x_bytes"] / copy["median_s"] / 1e9
            r["pct_of_bound"] = 100 * moves * copy["median_s"] / (2 * r["median_s"])
        base = copy if r["kind"] == "fwd" else traffic
        if base is not None:
            r["vs_baseline"] = r["median_s"] / base["median_s"]
        if r["role"] == "baseline":
            continue
        peers = [q for q in ok if q["role"] == "peer" and _same_program(q, r)]
        if peers:
            best = min(peers, key=lambda q: q["median_s"])
            r["best_peer"] = best["impl"]
            r["vs_best_peer"] = r["median_s"] / best["median_s"]


def _same_program(a: dict, b: dict) -> bool:
    return a["group"] == b["group"] and a["kind"] == b["kind"]


# ---------------------------------------------------------------- the train step


def step_norms(platform: str) -> dict[str, dict]:
    """The norms of the train-step section: ``{label: prenorm_stack_train_step kwargs}``."""
    stat_only = jax.checkpoint_policies.save_only_these_names("rms_norm_stat")
    norms = {
        "rms_norm": dict(norm=IMPLEMENTATIONS["rms_norm"]),
        "flax RMSNorm": dict(norm=IMPLEMENTATIONS["flax RMSNorm"]),
        "flax LayerNorm": dict(norm=IMPLEMENTATIONS["flax LayerNorm"]),
        "jnp + autodiff": dict(norm=IMPLEMENTATIONS["jnp + autodiff"]),
        "add_rms_norm": dict(norm=None),
        "rms_norm, remat saving rms_norm_stat": dict(
            norm=IMPLEMENTATIONS["rms_norm"], remat_policy=stat_only
        ),
        "x * scale (floor)": dict(norm=scale_only),
    }
    if HAS_IMPLEMENTATION and platform != "cpu":
        norms["rms_norm [pallas]"] = dict(
            norm=lambda x, s: rmsnorm_jax.rms_norm(x, s, EPS, implementation="pallas")
        )
    return norms


def step_inputs(params_shapes, d: int, tokens: int, dtype):
    """Parameters (weights ~ N(0, 1/fan_in), scales of ones) and the input stream h."""
    leaves, treedef = jax.tree.flatten(params_shapes(d, dtype))
    keys = jax.random.split(jax.random.key(1), len(leaves) + 1)
    values = [
        (jax.random.normal(k, s.shape, jnp.float32) / math.sqrt(s.shape[-2])).astype(s.dtype)
        if len(s.shape) == 3
        else jnp.ones(s.shape, s.dtype)  # the scales: (layers, d) and (d,)
        for k, s in zip(keys[1:], leaves, strict=True)
    ]
    h = jax.random.normal(keys[0], (tokens, d), jnp.float32).astype(dtype)
    return jax.tree.unflatten(treedef, values), h


def memory_stats() -> dict | None:
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:
        return None
    return stats or None


def run_step_group(
    title: str, programs: dict, platform: str, timer, args, shape: dict
) -> list[dict]:
    """Compile, run once each for the memory, then time in interleaved rounds."""
    names = list(programs)
    # The first program alone fills XLA's autotuning cache for the GEMMs that every
    # program shares; the rest compile in parallel and find the same choices there.
    compiled = compile_all({names[0]: programs[names[0]]}, 1)
    compiled.update(compile_all({n: programs[n] for n in names[1:]}, args.compile_workers))
    rows = {}
    for name in names:
        row = dict(section="step", model=title, norm=name, **shape)
        if isinstance(compiled[name], str):
            row.update(status="failed", note=f"compile: {compiled[name]}")
        else:
            row["status"] = "ok"
            analysis = compiled[name][0].memory_analysis()
            for field in ("temp", "argument", "output"):
                value = getattr(analysis, f"{field}_size_in_bytes", None) if analysis else None
                row[f"{field}_bytes"] = value
        rows[name] = row
    runnable = {n: v for n, v in compiled.items() if not isinstance(v, str)}

    # Device memory: each program once, smallest compiled footprint first.
    def footprint(name):
        r = rows[name]
        return sum(r.get(f"{f}_bytes") or 0 for f in ("temp", "argument", "output"))

    for name in sorted(runnable, key=footprint):
        before = memory_stats()
        fn, fargs = runnable[name]
        try:
            out = fn(*fargs)
            jax.block_until_ready(out)
            del out
        except Exception as err:
            rows[name].update(status="failed", note=f"run: {_error(err)}")
            continue
        after = memory_stats()
        if after and "peak_bytes_in_use" in after:
            peak_before = (before or {}).get("peak_bytes_in_use", 0)
            rows[name].update(
                peak_bytes=after["peak_bytes_in_use"],
                peak_is_own=after["peak_bytes_in_use"] > peak_before,
                in_use_before_bytes=(before or {}).get("bytes_in_use"),
            )
    runnable = {n: v for n, v in runnable.items() if rows[n]["status"] == "ok"}
    timings = interleaved(runnable, timer, args.step_rounds)
    wall = {}
    if platform != "cpu" and runnable:
        # A step is far above a millisecond: wall-clock per step is meaningful too
        # (it includes the launch gaps that the kernels' sum leaves out).
        wall = interleaved(runnable, WallTimer(), args.step_rounds, warmup_rounds=0)
    for name, timing in timings.items():
        rows[name].update(timing)
        rows[name]["method"] = timer.method
        if name in wall and "median_s" in wall[name]:
            rows[name]["wall_median_s"] = wall[name]["median_s"]
    flax = rows.get("flax RMSNorm", {}).get("median_s")
    for row in rows.values():
        row["vs_flax"] = row["median_s"] / flax if flax and "median_s" in row else None
    return list(rows.values())


def prenorm_programs(mlp: str, dtype: str, platform: str, shape: dict) -> dict:
    programs = {}
    params = h = None
    for label, kw in step_norms(platform).items():
        step, params_shapes = prenorm_stack_train_step(layers=shape["layers"], mlp=mlp, **kw)
        if params is None:
            params, h = step_inputs(params_shapes, shape["d"], shape["tokens"], jnp.dtype(dtype))
        programs[label] = (step, (params, h))
    return programs


# ---------------------------------------------------------------- reports


def device_slug(device) -> str:
    if device.platform == "cpu":
        return "cpu"
    kind = device.device_kind
    gpu = re.search(r"\b(H100|H200|H20|A100|B200|B100|GB200|L40S|L4|A10G?)\b", kind)
    if gpu:
        return gpu.group(1).lower()
    tpu = re.fullmatch(r"TPU v(\d+)( lite|e|p)?", kind.strip())
    if tpu:
        suffix = {" lite": "e", "e": "e", "p": "p", None: ""}[tpu.group(2)]
        return f"tpu-v{tpu.group(1)}{suffix}"
    return re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-") or device.platform


def _us(seconds) -> str:
    return "" if seconds is None else f"{seconds * 1e6:,.1f}"


def _ms(seconds) -> str:
    return "" if seconds is None else f"{seconds * 1e3:,.2f}"


def _x(value) -> str:
    return "" if value is None else f"{value:.2f}"


def _mib(value) -> str:
    return "" if value is None else f"{value / 2**20:,.0f}"


def ops_markdown(rows: list[dict]) -> str:
    shapes = list(dict.fromkeys((r["size_mib"], r["features"], r["dtype"]) for r in rows))
    out = [
        "### Summary per shape",
        "",
        "Ratios are to the best peer (< 1: faster); % of bound is the least bytes the "
        "program must move over the copy rate measured for the same shape.",
        "",
        "| x MiB | features | dtype | copy us | copy GB/s | rms_norm fwd / copy "
        "| rms_norm fwd+bwd vs best peer (peer) | fwd, fwd+bwd % of bound "
        "| add_rms_norm fwd+bwd vs composition | gated_rms_norm fwd+bwd vs composition |",
        "|---:|---:|---|---:|---:|---:|---|---|---:|---:|",
    ]
    for size, f, dtype in shapes:
        at = {
            (r["impl"], r["kind"]): r
            for r in rows
            if (r["size_mib"], r["features"], r["dtype"]) == (size, f, dtype)
        }
        copy = at.get(("copy baseline", "fwd"), {})
        fwd = at.get(("rms_norm", "fwd"), {})
        fb = at.get(("rms_norm", "fwd+bwd"), {})
        add = at.get(("add_rms_norm", "fwd+bwd"), {})
        gated = at.get(("gated_rms_norm", "fwd+bwd"), {})
        bound = (
            f"{fwd['pct_of_bound']:.0f}%, {fb['pct_of_bound']:.0f}%"
            if fwd.get("pct_of_bound") and fb.get("pct_of_bound")
            else ""
        )
        out.append(
            f"| {size:g} | {f} | {dtype} | {_us(copy.get('median_s'))} "
            f"| {copy.get('copy_gbs', 0):,.0f} | {_x(fwd.get('vs_baseline'))} "
            f"| {_x(fb.get('vs_best_peer'))} ({fb.get('best_peer') or ''}) | {bound} "
            f"| {_x(add.get('vs_best_peer'))} | {_x(gated.get('vs_best_peer'))} |"
        )
    out += [
        "",
        "### Every program",
        "",
        "| x MiB | features | dtype | op | implementation | median us | min-max us "
        "| vs best peer | % of bound | vs baseline | kernels | note |",
        "|---:|---:|---|---|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ok = r.get("status") == "ok"
        spread = f"{_us(r.get('min_s'))}-{_us(r.get('max_s'))}" if ok else ""
        pct = f"{r['pct_of_bound']:.0f}%" if r.get("pct_of_bound") else ""
        note = r.get("note", "") if not ok else ("Pallas kernel" if r.get("uses_kernel") else "")
        if not ok:
            note = f"{r['status']}: {note}"
        out.append(
            f"| {r['size_mib']:g} | {r['features']} | {r['dtype']} | {r['kind']} | {r['impl']} "
            f"| {_us(r.get('median_s'))} | {spread} | {_x(r.get('vs_best_peer'))} | {pct} "
            f"| {_x(r.get('vs_baseline'))} | {len(r.get('kernels', [])) or ''} | {note} |"
        )
    return "\n".join(out)


def step_markdown(rows: list[dict]) -> str:
    out = [
        "| model | mlp | dtype | norm | step ms (median) | min-max ms | wall ms | vs flax "
        "RMSNorm | compiled temp MiB | device peak MiB | note |",
        "|---|---|---|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ok = r.get("status") == "ok" and "median_s" in r
        spread = f"{_ms(r.get('min_s'))}-{_ms(r.get('max_s'))}" if ok else ""
        peak = r.get("peak_bytes")
        peak_text = "" if peak is None else ("" if r.get("peak_is_own") else "<= ") + _mib(peak)
        note = "" if r.get("status") == "ok" else f"{r.get('status')}: {r.get('note', '')}"
        out.append(
            f"| {r['model']} | {r.get('mlp', '')} | {r.get('dtype', '')} | {r['norm']} "
            f"| {_ms(r.get('median_s'))} | {spread} | {_ms(r.get('wall_median_s'))} "
            f"| {_x(r.get('vs_flax'))} | {_mib(r.get('temp_bytes'))} | {peak_text} | {note} |"
        )
    return "\n".join(out)


def report_markdown(report: dict) -> str:
    lines = [
        f"# Measured on {report['device']}",
        "",
        f"{report['machine']}. Written by `benchmarks/device_bench.py` {' '.join(report['argv'])}.",
        "",
    ]
    ops = report["sections"].get("ops")
    if ops:
        lines += [
            "## Isolated ops",
            "",
            f"{ops['method']}; {ops['rounds']} interleaved rounds after a warm-up round"
            + (f", {ops['iterations']} iterations per round" if ops.get("iterations") else "")
            + f"; run {ops['date']}.",
            "",
            ops_markdown(ops["results"]),
            "",
        ]
    step = report["sections"].get("step")
    if step:
        shape = step["shape"]
        lines += [
            "## Train step",
            "",
            f"`prenorm_stack_train_step`: {shape['layers']} layers, d {shape['d']}, "
            f"{shape['tokens']} tokens. {step['method']}; {step['rounds']} interleaved "
            f"rounds after a warm-up round; run {step['date']}. Device peak: "
            f"`peak_bytes_in_use` after the program's first run, each program on its own "
            f"in order of increasing compiled size (the peak cannot be reset: `<=` where it "
            f"did not rise, so the program's own peak is at most that). Wall ms: wall-clock "
            f"per step in separate interleaved rounds (accelerators only).",
            "",
            step_markdown(step["results"]),
            "",
        ]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone

    ops = report["sections"].get("ops", {}).get("results", [])
    step = report["sections"].get("step", {}).get("results", [])
    fig = Figure(figsize=(13, 4.5))
    ax_ops, ax_step = fig.subplots(1, 2)
    ours = ("rms_norm", "add_rms_norm", "gated_rms_norm", "rms_norm [pallas]")
    for impl in ours:
        pts = [
            r for r in ops if r["impl"] == impl and r["kind"] == "fwd+bwd" and r.get("vs_best_peer")
        ]
        if pts:
            labels = [f"{r['size_mib']:g}M {r['features']} {r['dtype'][:4]}" for r in pts]
            ax_ops.plot(labels, [r["vs_best_peer"] for r in pts], "o-", label=impl)
    ax_ops.axhline(1.0, color="gray", lw=1)
    ax_ops.set_ylabel("fwd+bwd time / best peer")
    ax_ops.tick_params(axis="x", labelrotation=90, labelsize=6)
    ax_ops.set_title("isolated ops")
    if ax_ops.has_data():
        ax_ops.legend(fontsize=7)
    groups = list(dict.fromkeys((r["model"], r.get("mlp"), r.get("dtype")) for r in step))
    norms = list(dict.fromkeys(r["norm"] for r in step))
    width = 0.8 / max(1, len(norms))
    for i, norm in enumerate(norms):
        values = [
            next(
                (
                    r.get("vs_flax") or 0
                    for r in step
                    if (r["model"], r.get("mlp"), r.get("dtype")) == g and r["norm"] == norm
                ),
                0,
            )
            for g in groups
        ]
        ax_step.bar(np.arange(len(groups)) + i * width, values, width, label=norm)
    ax_step.axhline(1.0, color="gray", lw=1)
    ax_step.set_xticks(
        np.arange(len(groups)) + 0.4 - width / 2,
        [" ".join(str(p) for p in g if p) for g in groups],
        fontsize=7,
    )
    ax_step.set_ylabel("step time / flax RMSNorm")
    ax_step.set_title("train step")
    if ax_step.has_data():
        ax_step.legend(fontsize=6)
    fig.suptitle(report["device"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_report(report: dict, out: Path, stem: str, with_plot: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str))
    (out / f"{stem}.md").write_text(report_markdown(report))
    if with_plot:
        plot(report, out / f"{stem}.png")


# ---------------------------------------------------------------- main


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run)")
    parser.add_argument("--only", choices=("ops", "step"), default=None)
    parser.add_argument(
        "--out",
        default=None,
        help="output directory (default: benchmarks/results, or a new temporary directory "
        "for --quick); with --only, the other section of an earlier result is kept",
    )
    parser.add_argument("--rounds", type=int, default=None, help="ops: rounds (default 5)")
    parser.add_argument(
        "--iterations", type=int, default=None, help="ops: iterations per round on a device"
    )
    parser.add_argument("--step-rounds", type=int, default=5, help="train step: rounds (>= 5)")
    parser.add_argument(
        "--step-iterations", type=int, default=2, help="train step: iterations per round"
    )
    parser.add_argument("--sizes", default=None, help="MiB of x, comma separated")
    parser.add_argument("--features", default=None, help="comma separated")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument(
        "--compile-workers",
        type=int,
        default=None,
        help="threads compiling programs (default: 8 on an accelerator, 1 on CPU)",
    )
    args = parser.parse_args(argv)
    platform = device_platform(jax.devices()[0])
    if args.quick:
        sizes, features = (0.125,), (256,)
        args.rounds = args.rounds or 3
    else:
        sizes, features = SIZES_MIB, FEATURES
        args.rounds = args.rounds or 5
    args.sizes = [float(s) for s in args.sizes.split(",")] if args.sizes else list(sizes)
    args.features = [int(f) for f in args.features.split(",")] if args.features else features
    args.dtypes = args.dtypes.split(",")
    args.iterations = args.iterations or (1 if platform == "cpu" else 10)
    if args.compile_workers is None:
        args.compile_workers = 1 if platform == "cpu" else min(8, os.cpu_count() or 1)
    if args.step_rounds < 1 or args.rounds < 1:
        parser.error("--rounds and --step-rounds must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    device = jax.devices()[0]
    platform = device_platform(device)
    out = bench.output_dir(args.out, args.quick, prefix="device_bench")
    stem = f"{device_slug(device)}-measured"
    print(f"device_bench: {bench.machine()}; writing {out / stem}.md/.json/.png", flush=True)
    report = dict(
        device=device.device_kind if platform != "cpu" else f"CPU ({bench._cpu_model()})",
        platform=platform,
        machine=bench.machine(),
        jax=jax.__version__,
        argv=argv,
        sections={},
    )
    previous = out / f"{stem}.json"
    if args.only and previous.exists():
        try:
            earlier = json.loads(previous.read_text())
            report["sections"].update(
                {k: v for k, v in earlier.get("sections", {}).items() if k != args.only}
            )
        except (OSError, ValueError):
            pass
    start = time.perf_counter()

    def elapsed() -> str:
        return f"[{time.perf_counter() - start:6.1f} s]"

    if args.only in (None, "ops"):
        timer = make_timer(platform, args.iterations)
        section = dict(
            date=time.strftime("%Y-%m-%d %H:%M"),
            rounds=args.rounds,
            iterations=args.iterations if platform != "cpu" else None,
            method=timer.method,
            results=[],
        )
        report["sections"]["ops"] = section
        total, done, ops_start = len(args.sizes) * len(args.dtypes) * len(args.features), 0, 0.0
        for mib in args.sizes:
            for dtype in args.dtypes:
                for f in args.features:
                    ops_start = ops_start or time.perf_counter()
                    rows = bench_op_shape(mib, f, dtype, platform, timer, args)
                    done += 1
                    eta = (time.perf_counter() - ops_start) / done * (total - done)
                    section["results"].extend(rows)
                    section["method"] = timer.method
                    rms = {r["kind"]: r for r in rows if r["impl"] == "rms_norm"}
                    print(
                        f"{elapsed()} ops {mib:g} MiB {dtype} {f}: rms_norm fwd "
                        f"{_us(rms['fwd'].get('median_s'))} us, fwd+bwd "
                        f"{_us(rms['fwd+bwd'].get('median_s'))} us "
                        f"({_x(rms['fwd+bwd'].get('vs_best_peer'))}x the best peer); shape "
                        f"{done}/{total}, ops done in about {eta:.0f} s",
                        flush=True,
                    )
                    write_report(report, out, stem)
                    gc.collect()
    if args.only in (None, "step"):
        shape = QUICK_STEP_SHAPE if args.quick else STEP_SHAPE
        timer = make_timer(platform, args.step_iterations)
        section = dict(
            date=time.strftime("%Y-%m-%d %H:%M"),
            rounds=args.step_rounds,
            iterations=args.step_iterations if platform != "cpu" else None,
            shape=shape,
            method=timer.method,
            results=[],
        )
        report["sections"]["step"] = section
        for mlp, dtype in QUICK_STEP_CONFIGS if args.quick else STEP_CONFIGS:
            if dtype not in args.dtypes:
                continue
            programs = prenorm_programs(mlp, dtype, platform, shape)
            rows = run_step_group("pre-norm stack", programs, platform, timer, args, shape)
            for r in rows:
                r.update(mlp=mlp, dtype=dtype)
            section["results"].extend(rows)
            section["method"] = timer.method
            print(
                f"{elapsed()} step {mlp} {dtype}: "
                + ", ".join(f"{r['norm']} {_ms(r.get('median_s'))} ms" for r in rows),
                flush=True,
            )
            write_report(report, out, stem)
            del programs
            gc.collect()
        for title, factory in EXTRA_STEPS.items():
            try:
                programs = factory(args.quick)
                rows = run_step_group(title, programs, platform, timer, args, {})
            except Exception as err:
                rows = [
                    dict(section="step", model=title, norm="", status="failed", note=_error(err))
                ]
            section["results"].extend(rows)
            print(f"{elapsed()} step {title}: done", flush=True)
            write_report(report, out, stem)
            gc.collect()
    write_report(report, out, stem, with_plot=True)
    print(report_markdown(report))
    print(f"{elapsed()} wrote {out / stem}.md, .json and .png", flush=True)
    report["out"], report["stem"] = str(out), stem
    return report


if __name__ == "__main__":
    main()
