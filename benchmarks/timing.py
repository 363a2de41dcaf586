"""How a program is timed: CUPTI device time on a GPU, wall-clock elsewhere, in interleaved
rounds; and a train step's compiled and peak memory."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import jax


@dataclasses.dataclass
class Sample:
    """One program's samples of one round: seconds each, and per sample its kernels."""

    seconds: list[float]
    kernels: list[list[tuple[str, float]]] | None = None


class CuptiTimer:
    """GPU device time: per iteration, the sum of the kernel times CUPTI recorded
    (``profiler.measure(f, aggregate=False, iterations=N)``), launch gaps left out."""

    method = "device time (CUPTI: per-iteration sum of the program's kernel times)"

    def __init__(self, iterations: int):
        self.iterations = iterations

    def sample(self, fn, args) -> Sample:
        try:
            its = self._measure(fn, args, self.iterations)
        except RuntimeError as err:
            # measure() refuses kernels that differ between iterations: one per call then.
            if self.iterations == 1 or "iteration" not in str(err):
                raise
            its = [it for _ in range(self.iterations) for it in self._measure(fn, args, 1)]
        kernels = [[(str(name), float(ms)) for name, ms in it] for it in its]
        return Sample([sum(ms for _, ms in it) * 1e-3 for it in kernels], kernels)

    @staticmethod
    def _measure(fn, args, iterations: int) -> list:
        from jax.experimental.mosaic.gpu import profiler

        _, timings = profiler.measure(fn, aggregate=False, iterations=iterations)(*args)
        if not timings:
            raise RuntimeError("CUPTI recorded no kernel for this program")
        return [timings] if isinstance(timings[0], tuple) else timings  # one iteration: flat


class WallTimer:
    """Wall-clock of one call per sample: a CPU's time, or a step's with its launch gaps."""

    method = "wall-clock, one call per sample"

    @staticmethod
    def sample(fn, args) -> Sample:
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        return Sample([time.perf_counter() - t0])


def device_platform(device) -> str:
    """``"gpu"``, ``"tpu"`` or ``"cpu"`` (a CUDA device's platform reads ``"cuda"``)."""
    return "gpu" if device.platform in ("gpu", "cuda", "rocm") else device.platform


def make_timer(platform: str, iterations: int):
    return CuptiTimer(iterations) if platform == "gpu" else WallTimer()


def _error(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip().splitlines()
    return text[0][:300] if text else type(err).__name__


def interleaved(programs: dict, timer, rounds: int, warmup_rounds: int = 1) -> dict[str, dict]:
    """``{name: (fn, args)}``, each once per round (``warmup_rounds`` unrecorded first), each
    round starting one program later. Returns per name the median, min and max over every
    sample, each round's median and on a GPU the kernels (name, us) of the sample nearest
    the median; a program that raises is reported with its error and dropped."""
    programs, failed, got = dict(programs), {}, {name: [] for name in programs}
    for r in range(-warmup_rounds, rounds):
        names = list(programs)
        start = r % len(names) if names else 0
        for name in names[start:] + names[:start]:
            try:
                sample = (timer if r >= 0 else WallTimer).sample(*programs[name])
            except Exception as err:
                failed[name] = _error(err)
                del programs[name]
                continue
            got[name] += [sample] if r >= 0 else []
    out = {name: dict(status="failed", note=failed.get(name, "no samples")) for name in got}
    for name, samples in got.items():
        if name in failed or not samples:
            continue
        s = [t for sample in samples for t in sample.seconds]
        median, medians = statistics.median(s), [statistics.median(x.seconds) for x in samples]
        out[name] = dict(
            median_s=median, min_s=min(s), max_s=max(s), samples=len(s), round_medians_s=medians
        )
        if kernels := [k for sample in samples for k in sample.kernels or []]:
            near = kernels[min(range(len(s)), key=lambda i: abs(s[i] - median))]
            out[name]["kernels"] = [(k, round(t * 1e3, 3)) for k, t in near]
    return out


def compile_all(programs: dict, workers: int) -> dict:
    """``{name: (fn, args)}`` -> ``{name: (compiled, args) or the error}``: lowered in turn
    (tracing holds the GIL), compiled in ``workers`` threads (XLA releases it)."""

    def lower(item):
        name, (fn, args) = item
        try:
            return name, (jax.jit(fn).lower(*args), args)
        except Exception as err:
            return name, _error(err)

    def compile_one(item):
        name, value = item
        try:
            return item if isinstance(value, str) else (name, (value[0].compile(), value[1]))
        except Exception as err:
            return name, _error(err)

    lowered = [lower(item) for item in programs.items()]
    with ThreadPoolExecutor(max(1, workers)) as pool:
        return dict(pool.map(compile_one, lowered))


KERNEL_CALLS = {  # a Pallas kernel's custom call in a compiled program, by backend
    "Triton": r"__gpu\$xla\.gpu\.triton",
    "Mosaic GPU": r"mosaic_gpu",
    "Mosaic TPU": r"tpu_custom_call",
}


def kernel_backends(compiled) -> list[str]:
    """The Pallas backends whose kernels the compiled program calls (none: XLA alone)."""
    text = compiled.as_text()
    return [name for name, call in KERNEL_CALLS.items() if re.search(call, text)]


# ---------------------------------------------------------------- train steps


def own_peaks(commands: dict[str, list[str]], workers: int) -> dict[str, dict | str]:
    """``{name: the JSON line its command printed, or why it failed}``, each command
    (``python -m benchmarks.peak ...``) in a process of its own, ``workers`` at a time."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")

    def run(item):
        name, argv = item
        try:
            done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as err:
            return name, _error(err)
        if done.returncode or not done.stdout.strip():
            err = (done.stderr or done.stdout).strip().splitlines() or [""]
            why = next((e for e in reversed(err) if "rror" in e), err[-1])
            return name, f"exit {done.returncode}: {why[:300]}"
        return name, json.loads(done.stdout.strip().splitlines()[-1])

    with ThreadPoolExecutor(max(1, workers)) as pool:
        return dict(pool.map(run, commands.items()))


def memory_stats() -> dict | None:
    """The default device's ``memory_stats()`` (None on XLA:CPU, which reports none)."""
    try:
        return jax.devices()[0].memory_stats() or None
    except Exception:
        return None


def measure_steps(programs: dict, platform: str, timer, rounds: int, workers: int,
                  reference: str | None = None, peak_command=None) -> dict[str, dict]:  # fmt: skip
    """Train steps ``{label: (step, args)}`` (not donating): per label the compiled temp,
    argument and output bytes; where the device reports memory, ``peak_bytes`` of the step
    run in a process of its own (``peak_command(label)``: a process's peak cannot be
    reset); the times of :func:`interleaved`, on an accelerator ``wall_median_s`` too
    (with the launch gaps), and ``vs_reference``, the median over ``reference``'s."""
    first, *rest = programs
    # The first alone fills XLA's autotuning cache for the matmuls every step shares.
    compiled = compile_all({first: programs[first]}, 1)
    compiled |= compile_all({n: programs[n] for n in rest}, workers)
    rows, runnable = {}, {n: v for n, v in compiled.items() if not isinstance(v, str)}
    for name, value in compiled.items():
        rows[name] = dict(status="failed", note=f"compile: {value}")
        if name in runnable:
            mem = value[0].memory_analysis()
            fields = ("temp", "argument", "output")
            rows[name] = dict(status="ok") | {
                f"{f}_bytes": getattr(mem, f"{f}_size_in_bytes", None) for f in fields
            }
    stats = memory_stats() if platform != "cpu" else None
    if peak_command and stats and runnable:  # as many processes at once as the device holds
        size = max(
            sum(v or 0 for k, v in rows[n].items() if k.endswith("_bytes")) for n in runnable
        )
        room = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
        peaks = own_peaks(
            {n: peak_command(n) for n in runnable}, min(workers, int(0.7 * room) // max(size, 1))
        )
        for name, peak in peaks.items():
            if isinstance(peak, dict) and peak.get("peak_bytes"):
                rows[name].update(peak_bytes=peak["peak_bytes"], peak_is_own=True)
                rows[name]["in_use_before_bytes"] = peak.get("before_bytes")
            else:
                rows[name]["peak_note"] = f"own process: {peak}"
    timings = interleaved(runnable, timer, rounds)
    wall = interleaved(runnable, WallTimer(), rounds, 0) if platform != "cpu" else {}
    ref = timings.get(reference, {}).get("median_s")
    for name, timing in timings.items():
        rows[name].update(timing, method=timer.method, reference=reference)
        rows[name]["wall_median_s"] = wall.get(name, {}).get("median_s")
        rows[name]["vs_reference"] = (
            timing["median_s"] / ref if ref and "median_s" in timing else None
        )
    return rows
