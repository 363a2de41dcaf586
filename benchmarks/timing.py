"""How a program is timed: CUPTI on a GPU, a profiler trace on a TPU, wall-clock on a CPU.

A timer's ``round(programs)`` runs each ``{name: (fn, args)}`` once (``iterations`` times on a
device) and returns ``{name: Sample or the exception it raised}``; :func:`make_timer` picks the
timer for a platform. :func:`interleaved` runs every program once per round over many rounds
(after a warm-up round) and summarises the samples, so that no program is favoured by its
place in a fresh process; :func:`compile_all` compiles the programs (in threads), each
jitted under a name of its own (``dbp<NNNN>``) that a TPU trace uses to tell them apart.
:func:`measure_steps` measures a group of train steps: compiled memory, the device's peak
memory, then time in interleaved rounds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax

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
    """Wall-clock of one call per sample (a CPU's time, or a step's time with its launch
    gaps on an accelerator)."""

    method = "wall-clock, one call per sample"

    @staticmethod
    def sample(fn, args) -> Sample:
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        return Sample([time.perf_counter() - t0])

    def round(self, programs: dict) -> dict[str, Sample | Exception]:
        return _each(programs, self.sample)


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
    for r in range(rounds):
        # Each round starts one program later: no program is always first after the
        # pause between rounds (on the H200 the first program's round medians spread most).
        names = list(programs)
        order = names[r % len(names) :] + names[: r % len(names)] if names else names
        for name, sample in timer.round({n: programs[n] for n in order}).items():
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


# ---------------------------------------------------------------- train steps


def own_peaks(commands: dict[str, list[str]], workers: int) -> dict[str, dict | str]:
    """``{name: the JSON line its command printed, or why it failed}``: each command in a
    process of its own (``python -m benchmarks.peak``), ``workers`` at a time."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")

    def run(item):
        name, argv = item
        try:
            done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as err:
            return name, f"{type(err).__name__}: {err}"
        lines = done.stdout.strip().splitlines()
        if done.returncode or not lines:
            err = (done.stderr or done.stdout).strip().splitlines() or [""]
            why = next((e for e in reversed(err) if "Error" in e or "error" in e), err[-1])
            return name, f"exit {done.returncode}: {why[:300]}"
        return name, json.loads(lines[-1])

    with ThreadPoolExecutor(max(1, workers)) as pool:
        return dict(pool.map(run, commands.items()))


def memory_stats() -> dict | None:
    """The default device's ``memory_stats()`` (None on XLA:CPU, which reports none)."""
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:
        return None
    return stats or None


def measure_steps(
    programs: dict,
    platform: str,
    timer,
    rounds: int,
    workers: int,
    reference: str | None = None,
    peak_command: Callable[[str], list[str]] | None = None,
) -> dict[str, dict]:
    """A group of train steps: compile, measure each one's peak memory, time interleaved.

    ``programs``: ``{label: (step, args)}``; a step must not donate its arguments (each is
    called many times with the same ones). Returns ``{label: row}``: ``status``, the
    compiled ``temp_bytes``, ``argument_bytes`` and ``output_bytes``; where the device
    reports ``memory_stats()``, ``peak_bytes``: with ``peak_command`` (``label -> argv``
    of ``python -m benchmarks.peak ...``), the program's own ``peak_bytes_in_use`` from a
    process of its own (a process's peak cannot be reset), ``peak_is_own`` True;
    without it, or where that process fails, the peak after the program's first run in
    this process, in order of increasing compiled size, ``peak_is_own`` saying whether it
    rose (where not, the program's own peak is at most that); the timing of
    :func:`interleaved`; on an accelerator ``wall_median_s``, wall-clock per step in
    separate interleaved rounds (with the launch gaps that the kernels' sum leaves out);
    and ``vs_reference``, the ratio of the median to ``reference``'s.
    """
    names = list(programs)
    # The first program alone fills XLA's autotuning cache for the GEMMs that every
    # program shares; the rest compile in parallel and find the same choices there.
    compiled = compile_all({names[0]: programs[names[0]]}, 1)
    compiled.update(compile_all({n: programs[n] for n in names[1:]}, workers))
    rows = {}
    for name in names:
        row = {}
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
    own = {}
    stats = memory_stats() if platform != "cpu" else None
    if peak_command is not None and stats is not None and runnable:
        # As many processes at once as the device's memory holds (each its program's
        # compiled footprint, with room to spare): 8 Gemma steps of 20 GiB each ran an
        # H200 out of memory.
        largest = max(
            sum(rows[n].get(f"{f}_bytes") or 0 for f in ("temp", "argument", "output"))
            for n in runnable
        )
        room = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
        at_once = max(1, min(workers, int(0.7 * room) // max(largest, 1)))
        own = own_peaks({n: peak_command(n) for n in runnable}, at_once)
    for name, peak in own.items():
        if isinstance(peak, dict) and peak.get("peak_bytes"):
            rows[name].update(
                peak_bytes=peak["peak_bytes"],
                peak_is_own=True,
                in_use_before_bytes=peak.get("before_bytes"),
            )
        else:
            rows[name]["peak_note"] = f"own process: {peak}"

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
        if after and "peak_bytes_in_use" in after and not rows[name].get("peak_is_own"):
            peak_before = (before or {}).get("peak_bytes_in_use", 0)
            rows[name].update(
                peak_bytes=after["peak_bytes_in_use"],
                peak_is_own=after["peak_bytes_in_use"] > peak_before,
                in_use_before_bytes=(before or {}).get("bytes_in_use"),
            )
    runnable = {n: v for n, v in runnable.items() if rows[n]["status"] == "ok"}
    timings = interleaved(runnable, timer, rounds)
    wall = {}
    if platform != "cpu" and runnable:
        wall = interleaved(runnable, WallTimer(), rounds, warmup_rounds=0)
    for name, timing in timings.items():
        rows[name].update(timing)
        rows[name]["method"] = timer.method
        if name in wall and "median_s" in wall[name]:
            rows[name]["wall_median_s"] = wall[name]["median_s"]
    ref = rows.get(reference, {}).get("median_s") if reference else None
    for row in rows.values():
        row["vs_reference"] = row["median_s"] / ref if ref and "median_s" in row else None
        row["reference"] = reference
    return rows
