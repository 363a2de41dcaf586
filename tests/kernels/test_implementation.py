"""``implementation=``: which path computes a call, and the fused kernels through the public API.

On CPU ``"pallas"`` runs the GPU kernels in Pallas interpret mode; every result is
checked against the float64 oracle (the plain formula under ``jax.grad``). The dispatch
(what fits the kernels, ``"auto"``), the row-local calls under sharded ``jit`` and
``shard_map``, ``vmap``, remat names and grad-of-grad are checked here;
the kernels' own numerics in ``test_backends.py``.
"""

import contextlib
import dataclasses
import json
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import aot_target, gpu_kernel_call, multi_device_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import rmsnorm_jax
from rmsnorm_jax import add_rms_norm, aot, gated_rms_norm, kernels, rms_norm
from rmsnorm_jax.reference import rms_norm_reference

pytestmark = pytest.mark.newest

ROOT = Path(__file__).resolve().parents[2]
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def _inputs(shape, dtype, seed=0):
    kx, ks, kb, kr, kd = jax.random.split(jax.random.key(seed), 5)
    n = shape[-1]
    x = jax.random.normal(kx, shape, jnp.float32).astype(dtype)
    scale = 1 + 0.2 * jax.random.normal(ks, (n,), jnp.float32)
    bias = 0.1 * jax.random.normal(kb, (n,), jnp.float32)
    other = jax.random.normal(kr, shape, jnp.float32).astype(dtype)
    dy = jax.random.normal(kd, shape, jnp.float32)
    return x, scale, bias, other, dy


def _oracle_vjp(fn, args, dy):
    """Value and gradients of ``fn`` in float64 (the independent oracle)."""
    with jax.enable_x64(True):
        args64 = [jnp.asarray(np.asarray(a, np.float64)) for a in args]
        out, vjp = jax.vjp(fn, *args64)
        cts = jax.tree.map(lambda o: jnp.asarray(np.asarray(dy, np.float64)), out)
        return jax.tree.map(np.asarray, (out, vjp(cts)))


def _close(got, want, tol):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g = np.asarray(jnp.asarray(g, jnp.float32), np.float64)
        scale = max(1.0, float(np.max(np.abs(w))))
        np.testing.assert_allclose(g, w, atol=tol * scale, rtol=tol)


# ---------------------------------------------------------------- the dispatch


def test_unknown_implementation_names_the_choices():
    x = jnp.ones((2, 8))
    for fn in (
        lambda: rms_norm(x, implementation="tokamax"),
        lambda: add_rms_norm(x, x, implementation="cuda"),
        lambda: gated_rms_norm(x, x, implementation=None),
    ):
        with pytest.raises(ValueError, match=r"implementation must be one of .*'pallas'"):
            fn()


def _jaxpr(impl, x, scale):
    text = str(jax.make_jaxpr(jax.grad(lambda x: rms_norm(x, scale, implementation=impl).sum()))(x))
    # Some jax versions (0.10.0) print the rule functions with their addresses; two
    # traces make fresh closures, so compare the programs without them.
    return re.sub(r" at 0x[0-9a-f]+>", ">", text)


def test_auto_is_the_xla_path_where_nothing_was_measured():
    """No measured win on a CPU (nor on an H100, a TPU, ...): "auto" is the XLA path."""
    assert all(m.platform != "cpu" for m in kernels.MEASURED)
    x, scale, *_ = _inputs((4, 128), jnp.bfloat16)
    assert _jaxpr("auto", x, scale) == _jaxpr("xla", x, scale)
    assert "pallas_call" not in _jaxpr("auto", x, scale)


def _win(**kw):
    fields = dict(op="rms_norm", backend="triton", platform="cpu", device_kind="")
    fields.update(dtypes=("float32",), features=(64, 256), smallest_bytes=0)
    fields.update(jax=(jax.__version__,), results="a test", command="-", commit="-")
    fields.update(kw)
    return kernels.Measurement(**fields)


def test_auto_takes_the_kernels_exactly_where_a_measurement_says(monkeypatch):
    """A win recorded for this platform, dtype, width, size and jax puts "auto" on the
    kernels (on that platform only); any other call stays on XLA."""
    from rmsnorm_jax.kernels import _measured

    monkeypatch.setattr(_measured, "MEASURED", (_win(),))
    x, scale, *_ = _inputs((4, 128), jnp.float32)
    assert "pallas_call" in _jaxpr("auto", x, scale)
    got = jax.grad(lambda x, s: jnp.sum(rms_norm(x, s, implementation="auto") ** 2), (0, 1))
    want = jax.grad(lambda x, s: jnp.sum(rms_norm(x, s, implementation="xla") ** 2), (0, 1))
    _close(got(x, scale), want(x, scale), 2e-5)
    for other in [
        _inputs((4, 128), jnp.bfloat16)[:2],  # a dtype not measured
        _inputs((4, 512), jnp.float32)[:2],  # a width outside the range
    ]:
        assert "pallas_call" not in _jaxpr("auto", *other)
    for win in [
        _win(smallest_bytes=1 << 20),  # smaller than measured
        _win(op="add_rms_norm"),  # another function's win
        _win(platform="cuda"),  # measured on another platform
        _win(jax=("0.9",)),  # measured on another jax
    ]:
        monkeypatch.setattr(_measured, "MEASURED", (win,))
        assert "pallas_call" not in _jaxpr("auto", x, scale), win
    monkeypatch.setattr(_measured, "MEASURED", (_win(op="add_rms_norm"),))
    y = add_rms_norm(x, x, scale, implementation="auto")
    assert "pallas_call" in str(jax.make_jaxpr(lambda x: add_rms_norm(x, x, scale))(x))
    _close(y, add_rms_norm(x, x, scale, implementation="xla"), 2e-5)


H200 = kernels.Target.gpu("NVIDIA H200", 132)
H100 = kernels.Target.gpu("NVIDIA H100 80GB HBM3", 132)


def _auto(op, shape, dtype, target, version, monkeypatch=None, wins=None):
    """The "auto" route of ``op`` on ``shape`` for ``target`` and jax ``version``."""
    if wins is not None:
        from rmsnorm_jax.kernels import _measured

        monkeypatch.setattr(_measured, "MEASURED", wins)
    x = jax.ShapeDtypeStruct(shape, dtype)
    scale = jax.ShapeDtypeStruct(shape[-1:], jnp.float32)
    args = (x, x, scale) if op == "add_rms_norm" else (x, scale)
    fn = add_rms_norm if op == "add_rms_norm" else rms_norm
    return kernels.route_of(fn, *args, target=target, jax_version=version)


@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm"])
def test_auto_applies_a_win_only_on_the_jax_it_holds_for(op, monkeypatch):
    """The committed H200 wins (Triton kernels) hold for jax 0.11.2, where Pallas-Triton
    is deprecated: "auto" takes no backend that warns, so it is XLA there, and on jax
    0.10 and 0.12, where nothing was measured. A win that held for a jax where Triton is
    quiet would be taken, on an H200 only."""
    shape = (8192, 4096)
    for version in ("0.10.2", "0.11.2", "0.12.0"):
        found = _auto(op, shape, jnp.bfloat16, H200, version)
        assert found.spec is None, (version, found)
    assert "warns" in _auto(op, shape, jnp.bfloat16, H200, "0.11.2").reason
    older = _auto(op, shape, jnp.bfloat16, H200, "0.10.2").reason
    assert "measured on jax 0.11.2, not 0.10.2" in older
    quiet = tuple(dataclasses.replace(m, jax=("0.10",)) for m in kernels.MEASURED)
    found = _auto(op, shape, jnp.bfloat16, H200, "0.10.2", monkeypatch, quiet)
    assert found.spec is not None
    cuda = {kind: c for p, kind, c in found.choices if p == "cuda"}
    assert cuda["forward"].backend == cuda["backward"].backend == "triton"
    assert "h200-4ce9679" in cuda["forward"].reason
    assert all(c.backend is None for p, _, c in found.choices if p != "cuda")
    assert _auto(op, shape, jnp.bfloat16, H100, "0.10.2").spec is None  # not measured
    assert _auto(op, (8, 4096), jnp.bfloat16, H200, "0.10.2").spec is None  # too small
    wide = _auto(op, (8192, 8192), jnp.bfloat16, H200, "0.10.2")
    assert (wide.spec is not None) == (op == "add_rms_norm")  # rms_norm: 1.03-1.18x at 8192


def test_mosaic_gpu_wins_on_hopper_where_this_jax_has_it():
    """``"pallas"`` takes Mosaic GPU on an H100 where this jax has ``plgpu.kernel``, Triton
    where it has not, and Triton on an A100 (not Hopper) on every jax that ships it."""
    from rmsnorm_jax.kernels import mosaic_gpu

    x = jax.ShapeDtypeStruct((64, 1024), jnp.bfloat16)
    for target, hopper in ((H100, True), (kernels.Target.gpu("NVIDIA A100-SXM4-80GB"), False)):
        found = kernels.route_of(rms_norm, x, implementation="pallas", target=target)
        gpu = {c.backend for p, _, c in found.choices if p == "cuda"}
        want = "mosaic_gpu" if hopper and mosaic_gpu.available() else "triton"
        assert gpu == {want}, (target, found.choices)


def test_a_backend_by_name_runs_on_its_platform_alone():
    """``implementation=<backend>`` names the registry's backends: that backend on its
    platform (Triton interpreted on a CPU, the others there XLA), XLA on the others."""
    from rmsnorm_jax import _config
    from rmsnorm_jax.kernels import mosaic_gpu

    assert set(_config.IMPLEMENTATIONS) == {"auto", "xla", "pallas", *kernels.BACKENDS}
    x = jax.ShapeDtypeStruct((64, 1024), jnp.bfloat16)
    for name, entry in kernels.BACKENDS.items():
        found = kernels.route_of(rms_norm, x, implementation=name, target=H100)
        for platform, _, choice in found.choices:
            home = platform == entry.platform or (platform, name) == ("cpu", "triton")
            if not home:
                assert choice.backend is None and "alone" in choice.reason, (name, choice)
            elif name != "mosaic_gpu" or mosaic_gpu.available():
                assert choice.backend == name, (name, platform, choice)
    tpu_only = kernels.explain(rms_norm, x, implementation="mosaic_tpu")
    assert tpu_only.endswith("CPU: XLA (implementation='mosaic_tpu' runs on TPU alone)"), tpu_only


@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm"])
def test_triton_by_name_matches_the_float64_oracle(op):
    """``implementation="triton"`` through the public functions (interpreted on a CPU):
    values and gradients against the float64 formula."""
    x, scale, _, other, dy = _inputs((3, 5, 256), jnp.float32)
    if op == "rms_norm":
        ours = lambda x, s: rms_norm(x, s, 1e-5, implementation="triton")
        oracle = lambda x, s: rms_norm_reference(x, s, 1e-5)
    else:
        ours = lambda x, s: add_rms_norm(x, other, s, 1e-5, implementation="triton")[0]
        oracle = lambda x, s: rms_norm_reference(x + other.astype(x.dtype), s, 1e-5)
    y, vjp = jax.vjp(ours, x, scale)
    assert "pallas_call" in str(jax.make_jaxpr(ours)(x, scale))
    _close((y, vjp(dy)), _oracle_vjp(oracle, (x, scale), dy), TOL[jnp.float32])


def test_the_measured_wins_are_the_committed_measurement_and_say_where():
    """Every win names its results file, the command and head that wrote it, and the jax
    it holds for, and they are the file's own."""
    for win in kernels.MEASURED:
        saved = json.loads((ROOT / win.results).read_text())
        assert win.jax == (saved["jax"],) and win.commit in win.results
        assert saved["sections"]["ops"]["command"].startswith(win.command), win
        assert saved["device"].endswith(win.device_kind)
        rows = saved["sections"]["ops"]["results"]
        inside = [
            r["x_bytes"]
            for r in rows
            if r["impl"] == f"{win.op} [pallas]"
            and win.features[0] <= r["features"] <= win.features[1]
            and r["dtype"] in win.dtypes
        ]
        assert min(inside) == win.smallest_bytes, win


def test_the_measured_wins_are_what_their_runs_show():
    """Every committed win is what ``python -m benchmarks.wins`` derives from its results
    file (op, backend, device, dtypes, widths, smallest x, jax, command, commit), and every
    win a committed file shows is committed: the kernels faster forward+backward at every
    measured size inside, and no train step of the run slower with them (the H200's
    ``rms_norm`` at 2048 features, bfloat16: the pre-norm step took 1.02x and 1.01x)."""
    from benchmarks import wins as rule

    structural = lambda w: {k: v for k, v in w.items() if k not in ("measured", "ground")}
    committed = json.loads((ROOT / "rmsnorm_jax/kernels/data/measured_wins.json").read_text())
    by_file: dict = {}
    for win in committed["wins"]:
        by_file.setdefault((win["results"], win["commit"]), []).append(win)
    for (results, commit), wins in by_file.items():
        saved = json.loads((ROOT / results).read_text())
        # A run from before kernel_backends: the backend its "[pallas]" rows ran (the
        # H200's: Triton, the Mosaic GPU kernels came later); a later run records it.
        backends = {w["backend"] for w in wins}
        backend = backends.pop() if len(backends) == 1 else None
        derived = rule.derive(saved, results, pallas_backend=backend, commit=commit)
        assert sorted(map(structural, wins), key=str) == sorted(map(structural, derived), key=str)
    h200 = [w for w in kernels.MEASURED if w.device_kind == "H200" and w.op == "rms_norm"]
    assert {(w.dtypes, w.features) for w in h200} == {
        (("float32",), (1024, 5120)), (("bfloat16",), (1024, 1024)), (("bfloat16",), (4096, 5120))
    }  # fmt: skip


def _route(shape=(4, 64), dtype=jnp.float32, **kw):
    """The "pallas" route of ``rms_norm`` on ``shape``: its spec, or None (XLA)."""
    x = jax.ShapeDtypeStruct(shape, dtype)
    return kernels.route_of(rms_norm, x, implementation="pallas", **kw).spec


def test_what_the_kernels_take_and_what_stays_on_xla():
    n = 64
    assert _route() is not None
    assert _route((2, 3, n), jnp.bfloat16, scale=jnp.ones(n), bias=jnp.ones(n), p=0.25).k == 16
    assert _route(scale=jnp.ones((1, n))) is not None  # a Module's broadcast-shaped scale
    # XLA: a mask, several axes, an axis other than the last, float64, a scale per row.
    assert _route(mask=jnp.ones((4, n), bool)) is None
    assert _route((4, 8, 8), axis=(1, 2)) is None
    assert _route((4, n), axis=0) is None
    assert _route(scale=jnp.ones((4, n))) is None
    with jax.enable_x64(True):
        assert _route(dtype=jnp.float64) is None


# ---------------------------------------------------------------- numerics through the API


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rms_norm_pallas_matches_the_float64_oracle(dtype):
    x, scale, bias, _, dy = _inputs((3, 5, 100), dtype)
    kw = dict(p=0.07, scale_offset=1.0)

    def ours(x, scale, bias):
        return rms_norm(x, scale, 1e-5, bias=bias, implementation="pallas", **kw)

    def oracle(x, scale, bias):
        return rms_norm_reference(x, scale, 1e-5, bias=bias, **kw)

    y, vjp = jax.vjp(ours, x, scale, bias)
    assert y.dtype == jnp.float32 and y.shape == x.shape  # promotes with the f32 scale
    got = (y, vjp(dy.astype(y.dtype)))
    want = _oracle_vjp(oracle, (x, scale, bias), dy)
    _close(got, want, TOL[dtype])
    assert [g.dtype for g in got[1]] == [x.dtype, scale.dtype, bias.dtype]


def test_rms_norm_pallas_outside_eps_and_no_scale():
    x, *_, dy = _inputs((6, 48), jnp.float32)
    x = x.at[2].set(0.0)  # an all-zero row: the "outside" backward's limit
    got_y, vjp = jax.vjp(
        lambda x: rms_norm(x, None, 1e-3, eps_placement="outside", implementation="pallas"), x
    )
    want_y, (want_dx,) = _oracle_vjp(
        lambda x: rms_norm_reference(x, None, 1e-3, eps_placement="outside"), (x,), dy
    )
    got_dx = vjp(dy)[0]
    rest = np.arange(6) != 2  # autodiff of sqrt at 0 is NaN there; the limit is known:
    _close((got_y, got_dx[rest]), (want_y, want_dx[rest]), 2e-5)
    np.testing.assert_allclose(got_dx[2], dy[2] / 1e-3, rtol=1e-6)  # r = 1/eps, no cross term


@pytest.mark.parametrize("dtypes", [(jnp.bfloat16, jnp.float32), (jnp.float32, jnp.float32)])
def test_add_rms_norm_pallas_matches_the_float64_oracle(dtypes):
    x_dtype, stream_dtype = dtypes
    x, scale, bias, stream, dy = _inputs((2, 7, 256), x_dtype, seed=1)
    stream = stream.astype(stream_dtype)

    def ours(x, stream, scale, bias):
        return add_rms_norm(x, stream, scale, bias=bias, implementation="pallas")

    def oracle(x, stream, scale, bias):
        h = x + stream
        return rms_norm_reference(h, scale, 1e-6, bias=bias), h

    (y, h), vjp = jax.vjp(ours, x, stream, scale, bias)
    assert h.dtype == stream_dtype
    grads = vjp((dy.astype(y.dtype), dy.astype(h.dtype)))
    want = _oracle_vjp(oracle, (x, stream, scale, bias), dy)
    _close(((y, h), grads), want, TOL[x_dtype])
    assert [g.dtype for g in grads] == [x_dtype, stream_dtype, jnp.float32, jnp.float32]


def test_module_field_selects_the_kernels():
    x, *_ = _inputs((2, 4, 64), jnp.float32)
    layer = rmsnorm_jax.RMSNorm(implementation="pallas", scale_offset=1.0)
    variables = layer.init(jax.random.key(0), x)
    variables = jax.tree.map(lambda s: s + 0.3, variables)
    jaxpr = str(jax.make_jaxpr(lambda v: layer.apply(v, x))(variables))
    assert "pallas_call" in jaxpr
    want = rms_norm_reference(x, variables["params"]["scale"] + 1.0, 1e-6)
    np.testing.assert_allclose(layer.apply(variables, x), want, atol=2e-5)
    with pytest.raises(ValueError, match="implementation"):
        rmsnorm_jax.RMSNorm(implementation="fast").init(jax.random.key(0), x)


# ---------------------------------------------------------------- transformations


def test_vmap_remat_and_second_derivative():
    x, scale, *_, dy = _inputs((4, 6, 64), jnp.float32)

    def loss(impl):
        return lambda x, s: jnp.sum(rms_norm(x, s, implementation=impl) * dy[0])

    want = jax.vmap(jax.grad(loss("xla"), (0, 1)), (0, None))(x, scale)
    got = jax.vmap(jax.grad(loss("pallas"), (0, 1)), (0, None))(x, scale)
    _close(got, want, 2e-5)
    # A scale per example: each example its own parameters.
    scales = scale * jnp.arange(1.0, 5.0)[:, None]
    want = jax.vmap(lambda x, s: rms_norm(x, s, implementation="xla"))(x, scales)
    _close(jax.vmap(lambda x, s: rms_norm(x, s, implementation="pallas"))(x, scales), want, 2e-5)
    # Remat that keeps only the statistic: the same gradients.
    policy = jax.checkpoint_policies.save_only_these_names("rms_norm_stat")
    remat = jax.checkpoint(loss("pallas"), policy=policy)
    _close(jax.grad(remat, (0, 1))(x[0], scale), jax.grad(loss("xla"), (0, 1))(x[0], scale), 2e-5)

    # Second order: the kernel backward differentiates as its XLA twin.
    def grad_of_grad(impl):
        return jax.grad(lambda s: jnp.sum(jax.grad(loss(impl), 1)(x[0], s) ** 2))(scale)

    _close(grad_of_grad("pallas"), grad_of_grad("xla"), 2e-5)


# ---------------------------------------------------------------- sharding (8 host devices)


def _sharded_grads(x, scale, bias, dy):
    def loss(x, scale, bias):
        y = rms_norm(x, scale, bias=bias, p=0.5, implementation="pallas")
        return jnp.sum(y * dy)

    return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))


@pytest.mark.parametrize("spec", [P("data"), P("data", "model"), P(None, None, "model")])
def test_sharded_jit_keeps_rows_local(spec):
    """Automatic axes: each device normalizes its own rows; features split over 'model'
    are gathered (a kernel needs whole rows); the parameter gradients are all-reduced."""
    with multi_device_mesh((4, 2), ("data", "model")) as mesh:
        x, scale, bias, _, dy = _inputs((8, 4, 64), jnp.float32)
        step = _sharded_grads(x, scale, bias, dy)
        xs = jax.device_put(x, NamedSharding(mesh, spec))
        got = step(xs, scale, bias)
        want = jax.value_and_grad(
            lambda x, s, b: jnp.sum(rms_norm(x, s, bias=b, p=0.5, implementation="xla") * dy),
            (0, 1, 2),
        )(x, scale, bias)
        hlo = step.lower(xs, scale, bias).compile().as_text()
    _close(got, want, 2e-5)
    assert ("all-gather" in hlo) == (spec == P(None, None, "model"))
    assert got[1][0].sharding.spec == spec


def test_explicit_mesh_and_shard_map():
    with multi_device_mesh((4, 2), ("data", "model"), "explicit") as mesh:
        x, scale, bias, _, dy = _inputs((8, 4, 64), jnp.float32)
        want = jax.value_and_grad(
            lambda x, s, b: jnp.sum(rms_norm(x, s, bias=b, p=0.5, implementation="xla") * dy),
            (0, 1, 2),
        )(x, scale, bias)
        with jax.set_mesh(mesh):
            xs = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
            got = _sharded_grads(x, scale, bias, dy)(xs, scale, bias)
    _close(got, want, 2e-5)
    assert got[1][0].sharding.spec == P("data", "model", None)

    # Inside a user's shard_map the arrays are local already; a replicated scale's
    # gradient is summed over the rows' axis.
    def local(x, dy, scale, bias):
        return jax.grad(
            lambda x, s, b: jnp.sum(rms_norm(x, s, bias=b, p=0.5, implementation="pallas") * dy),
            (0, 1, 2),
        )(x, scale, bias)

    with multi_device_mesh((4, 2), ("data", "model")) as auto:
        mapped = jax.shard_map(
            local,
            mesh=auto,
            in_specs=(P("data"), P("data"), P(), P()),
            out_specs=(P("data"), P(), P()),
        )
        got = jax.jit(mapped)(x, dy, scale, bias)
    _close(got, want[1], 2e-5)


@pytest.mark.parametrize("spec", [P("data", "model"), P(None, "model"), P("model", "data")])
def test_explicit_features_split_keep_xla_shardings(spec):
    """Features split over an explicit mesh axis: the kernels run on whole rows, and every
    output, gradient and scan carry comes back with the XLA path's sharding and values."""
    x, scale, bias, _, _ = _inputs((8, 64), jnp.float32)
    r = x[::-1] * 0.5

    def forward(impl):
        def fn(x, r, s, b):
            y, h = add_rms_norm(x, r, s, bias=b, implementation=impl)
            return rms_norm(y, s, p=0.5, implementation=impl), h

        return fn

    def loss(impl):
        return lambda x, r, s, b: sum(jnp.sum(o * o) for o in forward(impl)(x, r, s, b))

    def carried(impl):
        def step(c, _):
            return rms_norm(c, scale_s, implementation=impl), None

        return lambda x: jax.lax.scan(step, x, None, length=2)[0]

    with multi_device_mesh((2, 4), ("data", "model"), "explicit") as mesh, jax.set_mesh(mesh):
        param = P(spec[-1])
        xs = jax.device_put(x, NamedSharding(mesh, spec))
        rs = jax.device_put(r, NamedSharding(mesh, spec))
        scale_s = jax.device_put(scale, NamedSharding(mesh, param))
        bias_s = jax.device_put(bias, NamedSharding(mesh, param))
        args = (xs, rs, scale_s, bias_s)
        results = {
            impl: (
                jax.jit(forward(impl))(*args),
                jax.jit(jax.grad(loss(impl), (0, 1, 2, 3)))(*args),
                jax.jit(carried(impl))(xs),
            )
            for impl in ("xla", "pallas")
        }
    want, got = results["xla"], results["pallas"]
    _close(got, want, 2e-5)
    shardings = jax.tree.map(lambda a: a.sharding.spec, (want, got))
    assert shardings[1] == shardings[0]


# ---------------------------------------------------------------- deviceless compiles

_ENTRY_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.-]+\s*=\s*(.*?)\s+([\w-]+)\(")
_PASS_THROUGH = {"parameter", "tuple", "get-tuple-element", "bitcast", "custom-call"}


def _touches(line: str, shape: tuple[int, int]) -> bool:
    """Whether ``line`` names an array of ``shape`` (rows x n), or a view of it whose first
    dim is the rows (Mosaic GPU's kernels take rows as ``(rows, n // S, S)``)."""
    rows, n = shape
    for dims in re.findall(r"\[([\d,]+)\]", line):
        sizes = [int(d) for d in dims.split(",")]
        if sizes[0] == rows and math.prod(sizes) == rows * n:
            return True
    return False


def _entry_ops(text: str, shape: tuple[int, int]) -> tuple[list[str], list[str]]:
    """(custom-call lines, other ops) of the entry computation touching a rows x n array."""
    entry = text[text.index("\nENTRY") :]
    calls, others = [], []
    for line in entry.splitlines()[1:]:
        match = _ENTRY_OP.match(line)
        if match is None or not _touches(line, shape):
            continue
        op = match.group(2)
        if op == "custom-call":
            calls.append(line)
        elif op not in _PASS_THROUGH:
            others.append(f"{op}: {line.strip()[:160]}")
    return calls, others


def _norm_step(x, stream, scale, dy):
    def loss(x, stream, scale):
        y, h = add_rms_norm(x, stream, scale, implementation="pallas")
        z = rms_norm(h, scale, p=0.25, implementation="pallas")
        return jnp.sum(y.astype(jnp.float32) * dy) + jnp.sum(z.astype(jnp.float32) * dy)

    return jax.grad(loss, (0, 1, 2))(x, stream, scale)


@pytest.mark.parametrize(
    "name, devices",
    [("h100x8", 8), ("tpu-v4", 8), ("tpu-v5e", 4), ("tpu-v5p", 4), ("tpu-v6e", 4), ("tpu7x", 8)],
)
def test_sharded_programs_run_the_kernels_on_local_rows(name, devices):
    """Rows sharded over every device: each runs the kernels on its own rows, and no
    other pass over a full-size array remains (GPU: automatic axes, custom_partitioning;
    TPU: explicit axes, shard_map: deviceless XLA:TPU has no custom-partitioning hook)."""
    target = aot_target(name)
    auto = target.platform == "cuda"
    kind = jax.sharding.AxisType.Auto if auto else jax.sharding.AxisType.Explicit
    mesh = jax.sharding.Mesh(np.array(target.devices), ("data",), axis_types=(kind,))
    rows, n = devices * 1024, 2048
    x = aot.struct((rows, n), jnp.bfloat16, mesh, P("data"))
    stream = aot.struct((rows, n), jnp.float32, mesh, P("data"))
    scale = aot.struct((n,), jnp.float32, mesh, P())
    dy = aot.struct((rows, n), jnp.float32, mesh, P("data"))
    with contextlib.nullcontext() if auto else jax.set_mesh(mesh):
        text = target.compile(jax.jit(_norm_step), x, stream, scale, dy).as_text()
    kernel = gpu_kernel_call(target.devices[0]) if auto else "tpu_custom_call"
    calls, others = _entry_ops(text, (rows // devices, n))
    kernels = [c for c in calls if kernel in c]
    assert len(kernels) == 4  # 2 forward, 2 backward
    # Besides the kernels: one conversion (the float32 gradient the two inputs share, to
    # x's bfloat16) and, on TPU, XLA moving an input into another memory space (VMEM,
    # S(1), or v4's S(3)): async copies, or v6e's ConcatBitcast of slices into VMEM.
    converts = [o for o in others if "convert" in o.split("=")[0]]
    moves = [o for o in others if o.startswith(("copy-start", "copy-done"))]
    moves += [c for c in calls if kernel not in c]
    assert all(re.search(r"S\([13]\)", m) for m in moves if "copy-done" not in m), moves
    assert len(converts) == 1 and len(others) + len(calls) == 1 + len(moves) + 4, others
    assert "all-gather" not in text and not _entry_ops(text, (rows, n))[0]


def test_h100_kernels_inside_a_checked_shard_map():
    target = aot_target("h100x8")
    mesh = jax.sharding.Mesh(np.array(target.devices), ("data",))
    x = aot.struct((8 * 512, 1024), jnp.bfloat16, mesh, P("data"))
    scale = aot.struct((1024,), jnp.float32, mesh, P())

    def local(x, scale):
        return jax.grad(lambda x, s: jnp.sum(rms_norm(x, s, implementation="pallas")), (0, 1))(
            x, scale
        )

    mapped = jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P()), out_specs=(P("data"), P()))
    text = target.compile(jax.jit(mapped), x, scale).as_text()
    assert text.count(gpu_kernel_call(target.devices[0])) >= 2


# ---------------------------------------------------------------- which path


def _gpu_label() -> str:
    from rmsnorm_jax.kernels import mosaic_gpu

    return "Mosaic GPU" if mosaic_gpu.available() else "Triton"


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(implementation="xla"), r"^xla: implementation='xla'$"),
        (dict(), r"^xla: 'auto': no measured win covers rms_norm on cpu \(cpu\), float32, 1000"),
        (dict(mask=jnp.ones((4, 1000), bool)), r"^xla: the kernels do not take a mask$"),
        (dict(axis=0), r"^xla: .*normalized axes \(0,\)"),
        (dict(x=jax.ShapeDtypeStruct((4, 1000), np.float64)), r"^xla: .*float64"),
        (dict(scale=jnp.ones((4, 1000))), r"^xla: .*not one value per feature"),
        (
            dict(implementation="pallas"),
            r"^pallas: GPU: {gpu}; TPU: Mosaic TPU; CPU: Triton in interpret mode$",
        ),
        (
            dict(x=jax.ShapeDtypeStruct((4, 1 << 18), jnp.float32), implementation="pallas"),
            r"^xla: no platform takes the kernels: GPU: XLA \(the row does not fit",
        ),
    ],
)
def test_explain_names_the_path_and_why(kwargs, expected):
    """``kernels.explain`` tells which path a call takes, and why, without running it:
    on a GPU, the Mosaic GPU kernels where this jax has them, else Triton."""
    expected = expected.format(gpu=_gpu_label())
    args = dict(x=jax.ShapeDtypeStruct((4, 1000), jnp.float32))
    args.update(kwargs)
    x = args.pop("x")
    with jax.enable_x64(x.dtype == jnp.float64):
        said = kernels.explain(rms_norm, x, **args)
    assert re.search(expected, said), said


def test_explain_runs_the_call_itself():
    """``explain`` runs the function's own checks and defaults (``"auto"``), for all three
    functions and for anything that calls one (a Module's ``apply``), and refuses a
    function that calls none."""
    x = jax.ShapeDtypeStruct((4, 1000), jnp.float32)
    assert kernels.explain(rms_norm, x) == kernels.explain(rms_norm, x, implementation="auto")
    assert kernels.explain(add_rms_norm, x, x).startswith("xla: 'auto': no measured win covers")
    for impl in ("auto", "pallas", "xla"):
        said = kernels.explain(gated_rms_norm, x, x, implementation=impl)
        want = "implementation='xla'" if impl == "xla" else "no fused kernel for gated_rms_norm"
        assert said.startswith("xla: ") and want in said, said
    layer = rmsnorm_jax.RMSNorm(implementation="pallas")
    variables = layer.init(jax.random.key(0), jnp.ones((4, 1000)))
    said = kernels.explain(lambda x: layer.apply(variables, x), x)
    assert said == kernels.explain(rms_norm, x, implementation="pallas"), said
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        kernels.explain(rms_norm, x, bogus=1)
    with pytest.raises(TypeError, match="x must be a real floating-point array"):
        kernels.explain(rms_norm, jax.ShapeDtypeStruct((4, 1000), jnp.int32))
    with pytest.raises(ValueError, match="p must be in"):
        kernels.explain(rms_norm, x, p=2.0)
    with pytest.raises(ValueError, match="implementation must be one of"):
        kernels.explain(add_rms_norm, x, x, implementation="tokamax")
    with pytest.raises(TypeError, match="made no call of rms_norm"):
        kernels.explain(jnp.sin, x)


@pytest.mark.parametrize(
    "op, shape, implementation",
    [
        ("rms_norm", (4, 64), "pallas"),
        ("rms_norm", (4, 1 << 18), "pallas"),
        ("rms_norm", (4, 64), "auto"),
        ("add_rms_norm", (4, 64), "pallas"),
        ("add_rms_norm", (4, 64), "xla"),
    ],
)
def test_explain_is_what_the_call_does(op, shape, implementation):
    """Where ``explain``'s route takes the kernels, the traced gradient holds them, and
    where it says XLA, it holds none: the two run the same ``route``."""
    fn = add_rms_norm if op == "add_rms_norm" else rms_norm
    x = jnp.ones(shape, jnp.float32)
    args = (x, x) if op == "add_rms_norm" else (x,)
    found = kernels.route_of(fn, *args, implementation=implementation)

    def loss(x):
        out = fn(*((x, x) if op == "add_rms_norm" else (x,)), implementation=implementation)
        return sum(jnp.sum(o) for o in jax.tree.leaves(out))

    traced = str(jax.make_jaxpr(jax.grad(loss))(x))
    assert (found.spec is not None) == ("pallas_call" in traced), found


def test_the_kernels_never_import_the_functions_above_them():
    """The arrows point one way: ``kernels`` imports the norm config (``_config``), the
    XLA path (``_xla``) and the helpers below it, never the public functions, the Modules
    or the integrations that call it."""
    import ast

    above = {"_rms_norm", "_llm_layers", "linen", "nnx", "integrations", "_module_utils"}
    for path in (ROOT / "rmsnorm_jax" / "kernels").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level >= 2:
                names = {node.module or ""} | {a.name for a in node.names}
                assert not names & above, (path.name, ast.unparse(node))
