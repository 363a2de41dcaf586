"""Compile for TPUs and GPUs on a machine that has neither, and read the compilers' estimates.

The real XLA:TPU compiler (libtpu) and XLA:GPU compiler (the CUDA plugin with ptxas)
run without a device ("deviceless" ahead-of-time compilation, as MaxText's
``train_compile.py`` does): they give the optimized program, the per-device memory and
each compiler's own cost estimate per kernel. Nothing runs and nothing is autotuned, so
an estimate is a cost model, not a hardware timing.

Install the compilers with ``pip install "rmsnorm_jax[aot]"`` and set
``JAX_PLATFORMS=cpu`` before jax is imported (otherwise the CUDA plugin tries to start
a GPU, fails, and never registers).

Targets, by name: ``cpu``; ``tpu-v4``, ``tpu-v5e``, ``tpu-v5p``, ``tpu-v6e``, ``tpu7x``
(Ironwood), each optionally with a topology (``tpu-v5e:2x4``, ``tpu-v5e:16x16``,
``tpu-v4:4x4x4``, ``tpu7x:2x2x2``);
``h100``, ``a100``, optionally with a device count (``h100x8``: one host, 8 GPUs).

Example (needs the ``aot`` extra, so not run as a doctest)::

    import os; os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    from rmsnorm_jax import aot, rms_norm

    target = aot.get_target("h100")
    mesh = target.mesh((1,), ("data",))
    x = aot.struct((4096, 8192), jnp.bfloat16, mesh, P())
    compiled = target.compile(jax.jit(rms_norm), x)
    print(aot.estimate(compiled, target))   # microseconds, the compiler's cost model
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

INSTALL = 'pip install "rmsnorm_jax[aot]"'

# The default slice of each TPU generation and its HBM bandwidth per chip in bytes/s
# (Google Cloud's published figures); libtpu's topology names. TPU7x (Ironwood) is
# named as Google Cloud and libtpu name it. Its chip has two TensorCores that are two
# devices (libtpu lists 8 for tpu7x:2x2x1, two per chip), each with its own half of
# the HBM: one device has half the chip's 7.37 TB/s.
_TPUS = {
    "tpu-v4": ("v4", "2x2x1", 1.228e12),
    "tpu-v5e": ("v5e", "2x2", 0.819e12),
    "tpu-v5p": ("v5p", "2x2x1", 2.765e12),
    "tpu-v6e": ("v6e", "2x2", 1.640e12),
    "tpu7x": ("tpu7x", "2x2x1", 7.37e12 / 2),
}
# XLA's published GPU device descriptions (GpuTargetConfigProto, text form), shipped
# in aot_targets/. The bandwidth is read from the file itself. The second field says
# whether XLA:GPU has a cost model for the GPU: its per-kernel estimate needs measured
# op profiles, which jaxlib 0.10 to 0.12 hold for sm_90 but not sm_80 (asking for it
# fails the compile with "NOT_FOUND: Cannot find key: sm_80").
_GPUS = {"h100": ("h100_sxm.txtpb", True), "a100": ("a100_sxm_80.txtpb", False)}
_CONFIG_DIR = Path(__file__).parent / "aot_targets"


def target_names() -> list[str]:
    """The valid base names; TPU names take ``:TOPOLOGY``, GPU names ``xN``."""
    return ["cpu", *_TPUS, *_GPUS]


@dataclasses.dataclass(frozen=True)
class Target:
    """One compile target: its devices (no hardware behind them) and its options.

    Attributes:
      name: the canonical name, e.g. ``"tpu-v5e:2x2"`` or ``"h100x8"``.
      platform: ``"cpu"``, ``"tpu"`` or ``"cuda"``.
      devices: the target's devices, in the order a mesh is built from.
      hbm_bytes_per_s: memory bandwidth of one device (None for ``cpu``).
      has_cost_model: whether the compiler estimates the target's kernels (False for
        ``cpu`` and ``a100``: see :func:`estimate`).
      extra_options: further compiler options, as ``(name, value)`` pairs; e.g.
        ``dataclasses.replace(target, extra_options=((name, False),))`` with ``name =
        "xla_gpu_enable_latency_hiding_scheduler"``.
    """

    name: str
    platform: str
    devices: tuple[Any, ...]
    hbm_bytes_per_s: float | None
    has_cost_model: bool = True
    extra_options: tuple[tuple[str, Any], ...] = ()

    @property
    def estimate_unit(self) -> str | None:
        """What :func:`estimate` returns: ``"cycles"`` (TPU), ``"us"`` (GPU), or None
        where the compiler has no cost model for the target (``cpu``, ``a100``)."""
        if not self.has_cost_model:
            return None
        return {"tpu": "cycles", "cuda": "us"}.get(self.platform)

    @property
    def compiler_options(self) -> dict[str, Any]:
        """Options that make the GPU compiler write its per-kernel cost estimate, and
        :attr:`extra_options`."""
        options = dict(self.extra_options)
        if self.platform == "cuda" and self.has_cost_model:
            options["xla_gpu_collect_cost_model_stats"] = True
        return options

    def mesh(self, shape: Sequence[int], axis_names: Sequence[str]) -> Mesh:
        """A mesh of the target's devices, e.g. ``target.mesh((4, 2), ("data", "model"))``."""
        shape = tuple(int(d) for d in shape)
        if int(np.prod(shape)) != len(self.devices):
            raise ValueError(
                f"mesh shape {shape} has {int(np.prod(shape))} devices but target "
                f"{self.name!r} has {len(self.devices)}; give a shape whose product is "
                f"{len(self.devices)} (or pick a target with that many devices)."
            )
        return Mesh(np.array(self.devices, dtype=object).reshape(shape), tuple(axis_names))

    def compile(self, jitted, *args, **kwargs) -> jax.stages.Compiled:
        """``jitted.lower(*args, **kwargs).compile()`` with this target's options.

        The arguments are ``jax.ShapeDtypeStruct``s whose shardings live on a mesh of
        this target's devices (see :func:`struct`); that is what picks the compiler.
        """
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:  # no mesh set by the caller: name the target's
            mesh = _target_mesh(self, args, kwargs)
        with jax.sharding.use_abstract_mesh(mesh):
            lowered = jitted.lower(*args, **kwargs)
            return lowered.compile(compiler_options=self.compiler_options)


def _target_mesh(target: Target, args, kwargs) -> jax.sharding.AbstractMesh:
    """The abstract mesh a program for ``target`` is lowered under.

    It names the target's device kind: Pallas-Triton reads the GPU's compute capability
    from it when no GPU is attached (jax >= 0.12; before, it assumed 9.0). The mesh of
    the first sharded argument where there is one, else one of all the target's devices.
    """
    for leaf in jax.tree.leaves((args, kwargs)):
        mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
        if isinstance(mesh, Mesh) and mesh.devices.flat[0] in target.devices:
            return mesh.abstract_mesh
    return Mesh(np.array(target.devices, dtype=object), ("devices",)).abstract_mesh


def struct(shape, dtype, mesh: Mesh, spec) -> jax.ShapeDtypeStruct:
    """An abstract argument sharded by ``spec`` over ``mesh`` (nothing is allocated)."""
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=NamedSharding(mesh, spec))


def _unknown(name: str) -> ValueError:
    return ValueError(
        f"unknown compile target {name!r}; valid names are {', '.join(target_names())} "
        f"(TPUs optionally with a topology, e.g. 'tpu-v5e:2x4'; GPUs optionally with a "
        f"device count, e.g. 'h100x8')."
    )


def _wanted_libtpu(jax_requires: Sequence[str]) -> str | None:
    """The libtpu version pattern (e.g. ``"0.0.42.*"``) that jax's ``tpu`` extra pins."""
    for requirement in jax_requires:
        match = re.match(r"libtpu\s*==\s*([\w.*]+)\s*;.*extra\s*==\s*.tpu.", requirement)
        if match:
            return match.group(1)
    return None


def _matches(version: str, pattern: str) -> bool:
    if pattern.endswith(".*"):
        return version == pattern[:-2] or version.startswith(pattern[:-1])
    return version == pattern


def compiler_mismatch(platform: str) -> str | None:
    """Why the installed compiler for ``platform`` does not fit the installed jaxlib, or
    None when it fits (or when a version cannot be read).

    Each compiler is built for one jaxlib: the CUDA plugin (``jax-cuda12-plugin`` and
    ``jax-cuda12-pjrt``) carries jaxlib's own version, and libtpu the version that jax's
    ``tpu`` extra pins (e.g. jax 0.10.2 wants libtpu 0.0.42.*, jax 0.12.0.1 0.0.50.*).
    """
    from importlib import metadata

    def installed(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    jaxlib = installed("jaxlib")
    if jaxlib is None:
        return None
    if platform == "cuda":
        for dist in ("jax-cuda12-plugin", "jax-cuda12-pjrt"):
            version = installed(dist)
            if version is not None and version != jaxlib:
                return f"{dist} {version} is built for jaxlib {version}, but jaxlib is {jaxlib}"
        return None
    libtpu = installed("libtpu")
    wanted = _wanted_libtpu(metadata.requires("jax") or [])
    if libtpu is not None and wanted is not None and not _matches(libtpu, wanted):
        return f"libtpu {libtpu} is installed, but jax {installed('jax')} needs libtpu=={wanted}"
    return None


def _check_compiler(platform: str) -> None:
    module = {"tpu": "libtpu", "cuda": "jax_plugins.xla_cuda12"}[platform]
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise RuntimeError(
            f"the {platform.upper()} compiler is not installed ({module} not found); "
            f"install it with: {INSTALL}"
        )
    if mismatch := compiler_mismatch(platform):
        raise RuntimeError(
            f"the {platform.upper()} compiler does not match the installed jax: {mismatch}. "
            f"Reinstall it for this jax with: {INSTALL} (it follows the installed jax)."
        )
    if platform == "cuda" and os.environ.get("JAX_PLATFORMS", "") != "cpu":
        raise RuntimeError(
            "compiling for a GPU without one needs JAX_PLATFORMS=cpu set before jax is "
            "imported (otherwise the CUDA plugin fails to start a device and does not "
            "register); e.g. `JAX_PLATFORMS=cpu python ...`."
        )


@functools.cache
def get_target(name: str) -> Target:
    """The compile target called ``name`` (see the module docstring for the names).

    Raises:
      ValueError: for an unknown name, listing the valid ones.
      RuntimeError: when the target's compiler is not installed, naming the install.
    """
    if not isinstance(name, str):
        raise TypeError(f"a target name must be a str such as 'tpu-v5e', got {name!r}.")
    if name == "cpu":
        devices = tuple(jax.devices("cpu"))
        return Target("cpu", "cpu", devices, None, has_cost_model=False)
    base, _, topology = name.partition(":")
    if base in _TPUS:
        generation, default_topology, bandwidth = _TPUS[base]
        topology = topology or default_topology
        if not re.fullmatch(r"\d+(x\d+){1,2}", topology):
            raise ValueError(
                f"topology {topology!r} of target {name!r} is not of the form AxB or AxBxC "
                f"(e.g. '{base}:{default_topology}')."
            )
        _check_compiler("tpu")
        from jax.experimental.topologies import get_topology_desc

        # No hardware to guard: skip the cloud metadata query and the lock file that
        # keeps a second process from opening a TPU.
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        tpus = get_topology_desc(topology_name=f"{generation}:{topology}", platform="tpu")
        return Target(f"{base}:{topology}", "tpu", tuple(tpus.devices), bandwidth)
    match = re.fullmatch(r"([a-z0-9]+?)(?:x(\d+))?", name)
    if match is None or match.group(1) not in _GPUS:
        raise _unknown(name)
    gpu, count = match.group(1), int(match.group(2) or 1)
    if count < 1:
        raise ValueError(f"target {name!r} asks for {count} GPUs; give at least one.")
    _check_compiler("cuda")
    from jax.experimental.topologies import get_topology_desc

    config_file, has_cost_model = _GPUS[gpu]
    config = (_CONFIG_DIR / config_file).read_text()
    gpus = get_topology_desc(platform="cuda", target_config=config, topology=f"1x1x{count}")
    found = re.search(r"memory_bandwidth:\s*(\d+)", config)
    assert found is not None, f"{config_file} names no memory_bandwidth"
    canonical = gpu if count == 1 else f"{gpu}x{count}"
    return Target(canonical, "cuda", tuple(gpus.devices), float(found.group(1)), has_cost_model)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel of a compiled program and the compiler's estimate of its cost."""

    name: str
    estimate: float


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.-]+)\s*=.*?backend_config=(\{.*\})\s*$")


def _gpu_time_us(config: dict) -> float | None:
    costs = config.get("reification_cost")
    if not costs:
        return None
    by_name = {c.get("name", ""): c for c in costs}
    chosen = by_name.get("indexing-cost-model") or by_name.get("") or costs[0]
    return float(chosen["exec_time_us"])


def _find_key(tree: Any, key: str) -> Any:
    """The first value stored under ``key`` anywhere in a JSON tree (depth first)."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        tree = list(tree.values())
    if isinstance(tree, list):
        for item in tree:
            found = _find_key(item, key)
            if found is not None:
                return found
    return None


def kernels(compiled: jax.stages.Compiled, target: Target) -> list[Kernel]:
    """The kernels of ``compiled`` that carry a cost estimate, in program order.

    TPU: every op's ``estimated_cycles`` (the TPU compiler's cost model), in cycles.
    GPU: every kernel's ``reification_cost`` (the ``indexing-cost-model`` entry where
    present, the default one otherwise), in microseconds; needs the target's
    ``compiler_options``. A loop body counts once. CPU: no estimates (empty list).
    """
    out = []
    for line in (compiled.as_text() or "").splitlines():
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        try:
            config = json.loads(match.group(2))
        except json.JSONDecodeError:
            continue
        if target.platform == "tpu":
            cycles = _find_key(config, "estimated_cycles")
            if cycles is not None:
                out.append(Kernel(match.group(1), float(cycles)))
        elif target.platform == "cuda":
            time_us = _gpu_time_us(config)
            if time_us is not None:
                out.append(Kernel(match.group(1), time_us))
    return out


def estimate(compiled: jax.stages.Compiled, target: Target) -> float | None:
    """The compiler's estimate for the whole program: the sum over :func:`kernels`.

    In cycles for a TPU target, microseconds for a GPU target; None where the compiler
    has no cost model for the target: ``cpu``, and ``a100`` (XLA:GPU holds no op
    profiles for sm_80; its programs compile and report memory, but carry no estimate).
    """
    if target.estimate_unit is None:
        return None
    return sum(k.estimate for k in kernels(compiled, target))


def has_barrier(lowered: jax.stages.Lowered) -> bool:
    """Whether a lowered program holds an ``optimization_barrier``.

    Read before optimization: XLA expands barriers away while compiling, leaving only
    their effect on fusion.
    """
    return "optimization_barrier" in lowered.as_text()
