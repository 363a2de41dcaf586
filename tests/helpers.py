"""Small shared helpers for the tests: the float64 oracle, tolerances per dtype, the
devices of multi-device tests (``multi_device_mesh``, ``devices_for``) and the skips of
deviceless-compile tests (``aot_target``, ``requires_deviceless``)."""

import contextlib
import importlib.util
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rmsnorm_jax.kernels import KernelSpec
from rmsnorm_jax.reference import rms_norm_reference

# Tolerances for comparing a result computed from dtype-d inputs with the float64
# oracle on the same input values: the output is rounded once to the dtype, and for
# low precision the scale and dy rounding add a few ulps.
TOL = {
    jnp.dtype(jnp.float64): dict(rtol=1e-12, atol=1e-12),
    jnp.dtype(jnp.float32): dict(rtol=2e-5, atol=2e-5),
    jnp.dtype(jnp.bfloat16): dict(rtol=2e-2, atol=2e-2),
    jnp.dtype(jnp.float16): dict(rtol=2e-3, atol=2e-3),
}


def kernel_spec(n, dtype, *, k=None, eps=1e-5, inside=True, offset=0.0, scale=True, bias=True):
    """The fused kernels' static description of a call: n features, the first k (default
    n) in the statistic, the output dtype."""
    return KernelSpec(
        n=n,
        k=n if k is None else k,
        eps=eps,
        inside=inside,
        scale_offset=offset,
        has_scale=scale,
        has_bias=bias,
        out_dtype=np.dtype(dtype),
    )


def offset_normal(shape, dtype=jnp.float32, seed=0) -> jax.Array:
    """Test inputs: ``1.5 * N(0, 1) + 0.2`` drawn in float32, then cast to ``dtype`` (rows
    with a non-zero mean, far from eps)."""
    return (1.5 * jax.random.normal(jax.random.key(seed), shape, jnp.float32) + 0.2).astype(dtype)


def tol(dtype):
    return TOL[jnp.dtype(dtype)]


def to64(tree):
    return jax.tree.map(lambda a: None if a is None else jnp.asarray(a, jnp.float64), tree)


def oracle_value_and_grads(x, scale, bias, ct, **kw):
    """Float64 y and (dx, dscale, dbias) of sum(y * ct) from the plain formula.

    Must run under ``jax.enable_x64(True)``.
    """
    x, scale, bias, ct = to64((x, scale, bias, ct))

    def loss(x, scale, bias):
        return jnp.sum(rms_norm_reference(x, scale, bias=bias, **kw) * ct)

    y = rms_norm_reference(x, scale, bias=bias, **kw)
    return y, jax.grad(loss, argnums=(0, 1, 2))(x, scale, bias)


def assert_close(actual, expected, rtol, atol):
    """Compares in float64; ``atol`` is relative to the largest magnitude expected.

    Sums such as the scale gradient grow with the number of rows, so an absolute
    tolerance has to be measured against the size of the result.
    """
    if expected is None:
        assert actual is None
        return
    expected = np.asarray(expected, np.float64)
    magnitude = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
    np.testing.assert_allclose(
        np.asarray(actual, np.float64), expected, rtol=rtol, atol=atol * magnitude
    )


# ---------------------------------------------------------------- a patched model against its own


def rel(ours, theirs):
    """max |ours - theirs| / max |theirs| (0 where both are all zeros)."""
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    scale = np.max(np.abs(theirs))
    return float(np.max(np.abs(ours - theirs)) / scale) if scale else float(np.any(ours))


def grad_rel(ours, theirs, largest):
    """max |ours - theirs| over the leaf's own largest gradient, or over 1 % of the
    model's largest where the leaf's is smaller: a gradient that is zero in exact
    arithmetic (a scalar before a norm, which is scale-invariant) is rounding noise in
    float32 in both models, and only its absolute size can be compared."""
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    scale = max(float(np.max(np.abs(theirs))), 0.01 * largest)
    return float(np.max(np.abs(ours - theirs))) / scale


def rel_l2(ours, reference):
    """||ours - reference|| / ||reference||, in float64."""
    ours, reference = np.asarray(ours, np.float64), np.asarray(reference, np.float64)
    return float(np.linalg.norm(ours - reference) / np.linalg.norm(reference))


# ---------------------------------------------------------------- several devices


def select_devices(n: int, default_devices, cpu_devices):
    """The ``n`` devices a multi-device test runs on, or None when there are too few.

    The default backend's when it has ``n`` (eight host CPUs here, a TPU slice, a GPU
    node); otherwise the host CPU backend's, which conftest.py gives eight devices beside
    a single accelerator.
    """
    for devices in (default_devices, cpu_devices):
        if len(devices) >= n:
            return list(devices)[:n]
    return None


def host_cpu_devices() -> list:
    """The host CPU backend's devices; empty where JAX_PLATFORMS leaves it out."""
    try:
        return jax.devices("cpu")
    except RuntimeError:  # JAX_PLATFORMS names an accelerator alone
        return []


@contextlib.contextmanager
def on_host_cpu(why: str):
    """Run the block on the host CPU backend, or skip saying ``why`` it must be XLA:CPU.

    For the tests whose claim is about XLA:CPU's arithmetic (bitwise equalities that
    XLA:CPU gives and XLA:GPU, free to contract and fuse differently per program, does
    not), so that they test the same thing beside an accelerator.
    """
    cpu = host_cpu_devices()
    if not cpu:
        pytest.skip(f"needs the host CPU backend ({why}); add cpu to JAX_PLATFORMS")
    with jax.default_device(cpu[0]):
        yield


def devices_for(n: int) -> list:
    """``n`` devices of one backend for a multi-device test, or skip naming what it needs."""
    cpu = host_cpu_devices()
    devices = select_devices(n, jax.devices(), cpu)
    if devices is None:
        fix = (
            "leave JAX_PLATFORMS unset, or add cpu to it (JAX_PLATFORMS=cuda,cpu), for "
            "conftest.py's 8 host CPU devices"
            if not cpu
            else f"ask for {n} host CPU devices in XLA_FLAGS "
            f"(--xla_force_host_platform_device_count={n}; conftest.py's default is 8)"
        )
        pytest.skip(
            f"needs {n} devices of one backend: the default backend "
            f"({jax.default_backend()}) has {jax.device_count()} and the host CPU backend "
            f"{len(cpu)} (JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')!r}); {fix}"
        )
    return devices


@contextlib.contextmanager
def multi_device_mesh(axis_shapes, axis_names, axis_types: str = "auto"):
    """A mesh over ``devices_for(prod(axis_shapes))``, and those devices' backend as the
    default device while it is in use.

    With the mesh on the host CPUs beside an accelerator, the test's inputs and its
    single-device reference are then computed on the mesh's backend too, so that a
    sharded result is compared with the same compiler's unsharded one. ``axis_types``:
    ``"auto"`` (every axis ``AxisType.Auto``) or ``"explicit"`` (jax.make_mesh's default).
    """
    kinds = {"auto": jax.sharding.AxisType.Auto, "explicit": jax.sharding.AxisType.Explicit}
    if axis_types not in kinds:
        raise ValueError(f"axis_types must be 'auto' or 'explicit', got {axis_types!r}")
    devices = devices_for(math.prod(axis_shapes))
    mesh = jax.make_mesh(
        axis_shapes, axis_names, (kinds[axis_types],) * len(axis_shapes), devices=devices
    )
    with jax.default_device(devices[0]):
        yield mesh


# ---------------------------------------------------------------- deviceless compiles

_COMPILERS = {"tpu": "libtpu", "cuda": "jax_plugins.xla_cuda12"}


def deviceless_skip_reason(target_name: str) -> str | None:
    """Why a deviceless compile for ``target_name`` cannot run in this process, or None.

    ``rmsnorm_jax.aot`` needs ``JAX_PLATFORMS=cpu`` (set by conftest.py on a machine
    without an accelerator) and the target's compiler (the ``aot`` extra).
    """
    base = target_name.split(":")[0]
    if base == "cpu":
        if host_cpu_devices():
            return None
        return "target 'cpu' needs the host CPU backend, left out by JAX_PLATFORMS=" + repr(
            os.environ.get("JAX_PLATFORMS", "")
        )
    platform = "tpu" if base.startswith("tpu") else "cuda"
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms != "cpu":
        return (
            f"deviceless compile for {target_name!r} needs JAX_PLATFORMS=cpu (here "
            f"{platforms!r}: an accelerator is in use); run JAX_PLATFORMS=cpu pytest ... "
            f"on a machine with the compilers"
        )
    try:
        found = importlib.util.find_spec(_COMPILERS[platform]) is not None
    except ImportError:
        found = False
    if not found:
        return (
            f"deviceless compile for {target_name!r} needs the {platform.upper()} compiler "
            f"({_COMPILERS[platform]} not found): pip install 'rmsnorm_jax[aot]'"
        )
    return None


def requires_deviceless(*target_names: str):
    """A skip mark for tests that compile for ``target_names`` without the device."""
    reasons = [r for r in map(deviceless_skip_reason, target_names) if r]
    return pytest.mark.skipif(bool(reasons), reason="; ".join(reasons) or "runs")


def aot_target(name: str):
    """``rmsnorm_jax.aot.get_target(name)``, or skip with the reason it cannot be built."""
    reason = deviceless_skip_reason(name)
    if reason:
        pytest.skip(reason)
    from rmsnorm_jax import aot

    return aot.get_target(name)


def gpu_kernel_call(device=None) -> str:
    """What a GPU kernel of ours is called in a program compiled for ``device``, for the
    GPU kernels ``implementation="pallas"`` takes there with this jax
    (the route of a small call there): Mosaic GPU's custom call, or Pallas-Triton's."""
    from rmsnorm_jax import kernels, rms_norm
    from rmsnorm_jax.kernels import _device

    target = _device.target() if device is None else _device.describe(device)
    x = jax.ShapeDtypeStruct((64, 1024), jnp.bfloat16)
    found = kernels.route_of(rms_norm, x, implementation="pallas", target=target)
    (backend,) = {c.backend for p, _, c in found.choices if p == "cuda"}
    calls = {"mosaic_gpu": 'custom_call_target="mosaic_gpu', "triton": "__gpu$xla.gpu.triton"}
    return calls[backend]


# ---------------------------------------------------------------- the kernels' contract


def kernel_inputs(rows, n, dtype, seed=0, param_dtype=jnp.float32):
    """``(x, scale, bias, dy)`` for a kernel call of ``rows`` rows of ``n`` features."""
    keys = jax.random.split(jax.random.key(seed), 4)
    x = (2.0 * jax.random.normal(keys[0], (rows, n))).astype(dtype)
    scale = (1.0 + 0.3 * jax.random.normal(keys[1], (n,))).astype(param_dtype)
    bias = (0.1 * jax.random.normal(keys[2], (n,))).astype(param_dtype)
    dy = jax.random.normal(keys[3], (rows, n)).astype(dtype)
    return x, scale, bias, dy


def kernel_oracle(spec, x, scale, bias, dy):
    """Float64 ``y``, the statistic and ``(dx, dscale, dbias)`` of ``sum(y * dy)`` for a
    kernel ``spec``, by autodiff of the plain formula. Must run under x64."""
    x, scale, bias, dy = to64((x, scale, bias, dy))
    placement = "inside" if spec.inside else "outside"
    kw = dict(eps=spec.eps, k=spec.k, scale_offset=spec.scale_offset, eps_placement=placement)
    y, vjp = jax.vjp(lambda x, s, b: rms_norm_reference(x, s, bias=b, **kw), x, scale, bias)
    ms = jnp.mean(x[:, : spec.k] ** 2, axis=1)
    stat = 1 / jnp.sqrt(ms + spec.eps) if spec.inside else jnp.sqrt(ms)
    return y, stat, vjp(dy)


def check_kernel_outputs(spec, dtype, x, scale, bias, dy, got):
    """A backend's ``(y, stat, dx, dscale_partials, dbias_partials)`` against
    :func:`kernel_oracle`: ``dtype``'s tolerance for ``y`` and ``dx``, float32's for the
    statistic and the summed partials (float32 whatever the input dtype)."""
    y, stat, dx, dscale, dbias = got
    scale = scale if spec.has_scale else None
    bias = bias if spec.has_bias else None
    assert (y.dtype, stat.dtype, dx.dtype) == (spec.out_dtype, jnp.float32, x.dtype)
    assert y.shape == dx.shape == x.shape and stat.shape == x.shape[:1]
    with jax.enable_x64(True):
        y_o, stat_o, (dx_o, dscale_o, dbias_o) = kernel_oracle(spec, x, scale, bias, dy)
        assert_close(y, y_o, **tol(dtype))
        assert_close(stat, stat_o, **tol(jnp.float32))
        assert_close(dx, dx_o, **tol(dtype))
        for present, partials, want in (
            (spec.has_scale, dscale, dscale_o),
            (spec.has_bias, dbias, dbias_o),
        ):
            if present:
                assert partials.dtype == jnp.float32 and partials.shape[1:] == (spec.n,)
                assert_close(partials.sum(0), want, **tol(jnp.float32))
            else:
                assert partials is None
