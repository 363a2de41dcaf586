"""device_bench's train-step section: the pre-norm stack with each norm, its memory.

:func:`prenorm_programs` builds ``prenorm_stack_train_step`` with every norm of
:func:`step_norms`; :func:`run_step_group` compiles a group of steps, runs each once on its
own for the device's peak memory, then times them in interleaved rounds. More models join
through :data:`EXTRA_STEPS`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from device_ops import DTYPES, HAS_IMPLEMENTATION
from device_timing import WallTimer, _error, compile_all, interleaved
from implementations import EPS, IMPLEMENTATIONS, prenorm_stack_train_step, scale_only

import rmsnorm_jax

STEP_CONFIGS = tuple((mlp, dtype) for mlp in ("swiglu", "gelu") for dtype in DTYPES)
QUICK_STEP_CONFIGS = (("swiglu", "bfloat16"), ("gelu", "float32"))  # each MLP, each dtype
STEP_SHAPE = dict(layers=8, d=2048, tokens=16384)
QUICK_STEP_SHAPE = dict(layers=2, d=64, tokens=128)

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
