"""``rmsnorm_jax.integrations``: MaxText's and flax's RMSNorm routed through ``rms_norm``.

``patch_maxtext`` is tested against ``maxtext_standin`` (MaxText 0.2.5's ``RMSNorm``,
copied), and against MaxText itself where ``maxtext`` imports (the ``maxtext`` cases skip
otherwise). The oracle is the plain formula in float64; "ours" is recognised in a jaxpr by
the ``custom_vjp_call`` of ``rms_norm``'s core, which MaxText's and flax's norms lack.
"""

import importlib
import inspect
import subprocess
import sys
import textwrap
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import maxtext_standin
import numpy as np
import pytest
from flax import nnx
from helpers import (
    assert_close,
    devices_for,
    multi_device_mesh,
    offset_normal,
    rel_l2,
    to64,
    tol,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from maxtext_standin import RMSNorm as NormImportedByName  # as llama2.py imports it

from rmsnorm_jax import integrations, rms_norm
from rmsnorm_jax.reference import rms_norm_reference

EPS = 1e-6


def _import_maxtext():
    """MaxText's normalizations module, or None. Importing MaxText turns flax's eager
    variable sharding off for the whole process (``maxtext/layers/nnx_wrappers.py``);
    the other tests of the session expect flax's default, so it is put back."""
    from flax import config as flax_config

    saved = getattr(flax_config, "flax_always_shard_variable", None)
    try:
        return importlib.import_module("maxtext.layers.normalizations")
    except ImportError:
        return None
    finally:
        if saved is not None:
            flax_config.update("flax_always_shard_variable", saved)


REAL = _import_maxtext()
NO_MAXTEXT = "MaxText is not importable here (pip install maxtext, Python >= 3.12)"


@pytest.fixture(params=["standin", "maxtext"])
def mt(request):
    """MaxText's ``normalizations`` module: the stand-in, or the real one where it imports."""
    if request.param == "maxtext":
        if REAL is None:
            pytest.skip(NO_MAXTEXT)
        return REAL
    return maxtext_standin


@pytest.fixture(autouse=True)
def _restore():
    """Every test starts and ends with the libraries' own methods."""
    yield
    integrations.unpatch_flax()
    for module in (maxtext_standin, REAL):
        if module is not None:
            integrations.unpatch_maxtext(module=module)


def uses_ours(fn, *args) -> bool:
    """Whether ``fn(*args)`` computes a norm with ``rms_norm``: its jaxpr holds the
    statistic named ``"rms_norm_stat"``. Traced now: a cached trace of ``fn`` would keep
    the method it was traced with."""
    return "name=rms_norm_stat" in str(jax.make_jaxpr(lambda *a: fn(*a))(*args))


def call(norm, x, **kw):
    """``norm(x)`` under a jit traced now (a cached trace would keep an earlier method)."""
    return nnx.jit(lambda n, x: n(x, **kw))(norm, x)


def trained(norm, seed=3, offset=0.0):
    """Gives ``norm`` a checkpoint-like scale (not the init's ones or zeros)."""
    if norm.scale is None:
        return norm
    shape = norm.scale.get_value().shape
    value = offset + 0.1 * jax.random.normal(jax.random.key(seed), shape)
    norm.scale.set_value(value.astype(norm.scale.get_value().dtype))
    return norm


def jitted_rms_norm(x, scale, **kw):
    """``rms_norm`` under jit, as the patched methods run in these tests."""
    return jax.jit(lambda x, scale: rms_norm(x, scale, EPS, **kw))(x, scale)


class Holder(nnx.Module):
    """A model attribute: MaxText's Qwen3NextRMSNorm returns ``nnx.data(RMSNorm(...))``."""

    def __init__(self, norm):
        self.norm = norm


def oracle(x, scale, scale_offset=0.0):
    with jax.enable_x64(True):
        x64, s64 = to64((x, scale))
        return np.asarray(rms_norm_reference(x64, s64, EPS, scale_offset=scale_offset))


# ---------------------------------------------------------------- the stand-in is MaxText's


@pytest.mark.skipif(REAL is None, reason=NO_MAXTEXT)
def test_standin_has_maxtexts_signatures_and_outputs():
    for name in ("RMSNorm", "GlobalRMSNorm"):
        for method in ("__init__", "__call__"):
            ours = inspect.signature(getattr(getattr(maxtext_standin, name), method))
            real = inspect.signature(getattr(getattr(REAL, name), method))
            assert list(ours.parameters) == list(real.parameters), (name, method)
            for p in ours.parameters.values():
                default, real_default = p.default, real.parameters[p.name].default
                if p.name == "shard_mode":
                    assert default.value == real_default.value
                elif p.name != "scale_init":
                    assert default == real_default, p.name
    x = offset_normal((6, 256), jnp.bfloat16)
    for kw in ({}, {"scale_offset": 1.0}, {"with_scale": False}, {"dtype": jnp.float32}):
        kw = {"dtype": jnp.bfloat16, **kw}
        a = trained(maxtext_standin.RMSNorm(256, **kw, rngs=nnx.Rngs(0)))
        b = trained(REAL.RMSNorm(256, **kw, rngs=nnx.Rngs(0)))
        assert jnp.array_equal(call(a, x), call(b, x)), kw


# ---------------------------------------------------------------- patch_maxtext: numerics


@pytest.mark.parametrize("scale_offset", [0.0, 1.0])
def test_maxtext_formula_unpatched(mt, scale_offset):
    """MaxText rounds x_hat to dtype and multiplies the scale in dtype; with an offset it
    multiplies in float32 and rounds once."""
    norm = trained(mt.RMSNorm(256, dtype=jnp.bfloat16, scale_offset=scale_offset, rngs=nnx.Rngs(0)))
    x = offset_normal((8, 256), jnp.bfloat16)
    scale = norm.scale.get_value()
    xf = x.astype(jnp.float32)
    x_hat = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + EPS)
    if scale_offset:
        expected = (x_hat * (scale + scale_offset)).astype(jnp.bfloat16)
    else:
        expected = x_hat.astype(jnp.bfloat16) * scale.astype(jnp.bfloat16)
    assert jnp.array_equal(call(norm, x), expected)


@pytest.mark.parametrize("scale_offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_patched_maxtext_is_rms_norm(mt, dtype, scale_offset):
    norm = mt.RMSNorm(256, dtype=dtype, scale_offset=scale_offset, rngs=nnx.Rngs(0))
    trained(norm)
    x = offset_normal((4, 8, 256), dtype)
    theirs = call(norm, x)
    with integrations.patch_maxtext(module=mt):
        assert uses_ours(norm, x)
        ours = call(norm, x)
    expected = jitted_rms_norm(x, norm.scale.get_value(), scale_offset=scale_offset, dtype=dtype)
    assert ours.dtype == theirs.dtype == dtype
    assert jnp.array_equal(ours, expected)
    if dtype == jnp.float32:  # the same formula: the same bits
        assert jnp.array_equal(ours, theirs)
    ref = oracle(x, norm.scale.get_value(), scale_offset)
    assert_close(ours, ref, **tol(dtype))


def test_patched_maxtext_bfloat16_is_nearer_float64(mt):
    """One rounding against MaxText's two: ours is the nearer to the exact norm."""
    norm = trained(mt.RMSNorm(1024, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), offset=1.0)
    x = offset_normal((64, 1024), jnp.bfloat16)
    theirs = call(norm, x)
    with integrations.patch_maxtext(module=mt):
        ours = call(norm, x)
    ref = oracle(x, norm.scale.get_value())
    assert rel_l2(ours, ref) < 0.7 * rel_l2(theirs, ref)
    assert rel_l2(ours, ref) < 2.0**-8  # within one bfloat16 rounding


@pytest.mark.parametrize("scale_offset", [0.0, 1.0])
def test_patched_maxtext_gradients(mt, x64, scale_offset):
    norm = trained(mt.RMSNorm(128, scale_offset=scale_offset, rngs=nnx.Rngs(0)))
    x = offset_normal((4, 6, 128), jnp.float32)
    ct = offset_normal(x.shape, jnp.float32, seed=2)

    def grads(norm, x):
        return nnx.grad(lambda n, x: jnp.sum(n(x) * ct), argnums=(0, 1))(norm, x)

    theirs = nnx.jit(grads)(norm, x)
    with integrations.patch_maxtext(module=mt):
        ours = nnx.jit(grads)(norm, x)
    x64_, s64, ct64 = to64((x, norm.scale.get_value(), ct))
    loss = lambda x, s: jnp.sum(rms_norm_reference(x, s, EPS, scale_offset=scale_offset) * ct64)
    dx, dscale = jax.grad(loss, argnums=(0, 1))(x64_, s64)
    assert_close(ours[1], dx, **tol(jnp.float32))
    assert_close(ours[0].scale[...], dscale, **tol(jnp.float32))
    assert ours[0].scale[...].dtype == jnp.float32
    assert_close(ours[1], theirs[1], rtol=1e-6, atol=1e-6)
    assert_close(ours[0].scale[...], theirs[0].scale[...], rtol=1e-6, atol=1e-6)


def test_patched_maxtext_under_scan_and_remat(mt):
    """MaxText's scanned, rematerialised layers: a stack of norms under nnx.scan + remat."""

    @nnx.vmap(in_axes=0, out_axes=0)
    def stack(key):
        return trained(mt.RMSNorm(64, rngs=nnx.Rngs(key)), seed=0)

    norms = stack(jax.random.split(jax.random.key(0), 3))
    x = offset_normal((4, 64), jnp.float32)

    def loss(norms, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        @nnx.remat
        def layer(norm, h):
            return h + norm(h)

        return jnp.sum(jnp.sin(layer(norms, x)))

    def value_and_grads(norms, x):
        return nnx.value_and_grad(loss, argnums=(0, 1))(norms, x)

    theirs = nnx.jit(value_and_grads)(norms, x)
    with integrations.patch_maxtext(module=mt):
        graph, state = nnx.split(norms)
        pure = lambda state, x: loss(nnx.merge(graph, state), x)
        assert uses_ours(pure, state, x)  # inside the scan's body
        ours = nnx.jit(value_and_grads)(norms, x)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_patched_maxtext_implementation(implementation):
    norm = trained(maxtext_standin.RMSNorm(256, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    x = offset_normal((8, 256), jnp.bfloat16)
    with integrations.patch_maxtext(implementation, module=maxtext_standin) as patch:
        assert patch.implementation == implementation
        ours = call(norm, x)
    expected = jitted_rms_norm(
        x, norm.scale.get_value(), dtype=jnp.bfloat16, implementation=implementation
    )
    assert jnp.array_equal(ours, expected)


# ---------------------------------------------------------------- every norm site, the params


def _sites(mt):
    """MaxText's norm sites, as its models build them: the class by name (llama2.py and
    the decoders), QK-norm over head_dim, GlobalRMSNorm (Olmo3), Qwen3-Next's norm, a
    norm without scale. Each: (module, input)."""
    rngs = nnx.Rngs(0)
    by_name = NormImportedByName
    if mt is REAL:
        by_name = importlib.import_module("maxtext.models.llama2").RMSNorm
    x = offset_normal((2, 5, 64), jnp.bfloat16)
    heads = offset_normal((2, 5, 4, 16), jnp.bfloat16)
    return {
        "imported_by_name": (by_name(64, dtype=jnp.bfloat16, rngs=rngs), x),
        "qk_norm": (mt.RMSNorm(16, dtype=jnp.bfloat16, rngs=rngs), heads),
        "global": (mt.GlobalRMSNorm(64, dtype=jnp.bfloat16, rngs=rngs), heads),
        "qwen3_next": (Holder(mt.Qwen3NextRMSNorm(64, dtype=jnp.bfloat16, rngs=rngs)).norm, x),
        "no_scale": (mt.RMSNorm(64, dtype=jnp.bfloat16, with_scale=False, rngs=rngs), x),
    }


@pytest.mark.parametrize("built", ["before", "after"])
def test_patch_reaches_every_site(mt, built):
    sites = _sites(mt) if built == "before" else None
    with integrations.patch_maxtext(module=mt):
        sites = sites or _sites(mt)
        for name, (norm, x) in sites.items():
            assert uses_ours(norm, x), name
            y = call(norm, x)
            assert y.shape == x.shape and y.dtype == jnp.bfloat16, name
            scale = getattr(norm, "scale", None)
            scale = None if scale is None else scale.get_value()
            rows = x.reshape(*x.shape[:-2], -1) if name == "global" else x
            expected = jitted_rms_norm(rows, scale, scale_offset=norm.scale_offset, dtype=y.dtype)
            assert jnp.array_equal(y, expected.reshape(x.shape)), name


@pytest.mark.skipif(REAL is None, reason=NO_MAXTEXT)
# MaxText 0.2.5's nnx_wrappers on flax 0.12.12:
@pytest.mark.filterwarnings("ignore:The 'm.iter_modules\\(\\)' method:DeprecationWarning")
def test_patch_reaches_maxtexts_linen_wrapper():
    layer = REAL.rms_norm(64, dtype=jnp.bfloat16, name="norm")
    x = offset_normal((2, 5, 64), jnp.bfloat16)
    variables = layer.init(jax.random.key(0), x)
    with integrations.patch_maxtext(module=REAL):
        assert uses_ours(lambda x: layer.apply(variables, x), x)
        patched_variables = layer.init(jax.random.key(0), x)
    assert jax.tree.map(jnp.shape, patched_variables) == jax.tree.map(jnp.shape, variables)


@pytest.mark.parametrize("weight_dtype", [jnp.float32, jnp.bfloat16])
def test_parameters_are_maxtexts(mt, weight_dtype):
    """The same parameter (name, shape, dtype, metadata) whether built patched or not."""

    def build():
        rngs = nnx.Rngs(0)
        return Holder(
            mt.Qwen3NextRMSNorm(48, dtype=jnp.bfloat16, weight_dtype=weight_dtype, rngs=rngs)
        )

    theirs_model = build()
    with integrations.patch_maxtext(module=mt):
        ours_model = build()
    theirs, ours = theirs_model.norm, ours_model.norm
    graph_a, state_a = nnx.split(theirs_model)
    graph_b, state_b = nnx.split(ours_model)
    assert graph_a == graph_b
    assert jax.tree.map(lambda a: (a.shape, a.dtype), state_a) == jax.tree.map(
        lambda a: (a.shape, a.dtype), state_b
    )
    assert ours.scale.get_value().dtype == weight_dtype
    assert ours.scale.get_metadata() == theirs.scale.get_metadata()
    assert jnp.array_equal(ours.scale.get_value(), jnp.zeros(48, weight_dtype))
    # a checkpoint written by the unpatched model loads into the patched one
    trained(theirs)
    nnx.update(ours_model, nnx.state(theirs_model))
    assert jnp.array_equal(ours.scale.get_value(), theirs.scale.get_value())


# ---------------------------------------------------------------- sharding, host offload


@pytest.fixture
def explicit_mesh():
    with multi_device_mesh((4, 2), ("data", "model"), "explicit") as mesh, jax.set_mesh(mesh):
        yield mesh


def explicit_norm(mt, mesh, num_features):
    """A norm in explicit shard mode, its scale stored on "model" (kernel_axes). Placed
    here, not by flax's eager sharding: MaxText turns that off and places parameters
    itself."""
    norm = mt.RMSNorm(
        num_features, shard_mode=mt.ShardMode.EXPLICIT, kernel_axes=("model",), rngs=nnx.Rngs(0)
    )
    trained(norm, offset=1.0)
    norm.scale.set_value(jax.device_put(norm.scale.get_value(), NamedSharding(mesh, P("model"))))
    return norm


@pytest.mark.parametrize(
    "out_spec",
    [None, P("data", None, None), P("data", "model", None), P("data", None, "model", None)],
)
def test_patched_maxtext_explicit_sharding(mt, explicit_mesh, out_spec):
    """shard_mode=EXPLICIT: out_sharding (truncated to x.ndim) is the output's sharding,
    as in MaxText; values and gradients as MaxText's own."""
    mesh = explicit_mesh
    norm = explicit_norm(mt, mesh, 64)
    assert norm.scale.get_metadata()["out_sharding"] == ("model",)
    assert jax.typeof(norm.scale.get_value()).sharding.spec == P("model")
    x = jax.device_put(offset_normal((8, 4, 64)), NamedSharding(mesh, P("data", None, "model")))
    out = None if out_spec is None else NamedSharding(mesh, out_spec)

    def value_and_grads(norm, x):
        loss = lambda n, x: jnp.sum(jnp.sin(n(x, out_sharding=out)))
        return call(norm, x, out_sharding=out), nnx.grad(loss, argnums=(0, 1))(norm, x)

    theirs = nnx.jit(value_and_grads)(norm, x)
    with integrations.patch_maxtext(module=mt):
        ours = nnx.jit(value_and_grads)(norm, x)
    assert ours[0].sharding.spec == theirs[0].sharding.spec
    assert ours[1][1].sharding.spec == x.sharding.spec
    assert jax.typeof(ours[1][0].scale[...]).sharding.spec == P("model")
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_patched_maxtext_explicit_qk_norm(mt, explicit_mesh):
    """QK-norm: heads on "model", head_dim unsharded, the scale stored on "model". Under
    explicit sharding the scale is resharded like head_dim (MaxText does the same)."""
    mesh = explicit_mesh
    norm = explicit_norm(mt, mesh, 16)
    spec = P("data", None, "model", None)
    x = jax.device_put(offset_normal((8, 4, 2, 16)), NamedSharding(mesh, spec))
    grads = nnx.grad(lambda n, x: jnp.sum(jnp.sin(n(x))), argnums=(0, 1))
    theirs = call(norm, x), nnx.jit(grads)(norm, x)
    with integrations.patch_maxtext(module=mt):
        ours = call(norm, x), nnx.jit(grads)(norm, x)
    assert ours[0].sharding.spec == spec
    assert jax.typeof(ours[1][0].scale[...]).sharding.spec == P("model")
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_patched_maxtext_auto_mode_ignores_out_sharding(mt):
    """shard_mode=AUTO (MaxText's default): out_sharding is dropped, as MaxText drops it."""
    norm = mt.RMSNorm(32, rngs=nnx.Rngs(0))
    x = offset_normal((4, 32))
    with integrations.patch_maxtext(module=mt):
        y = call(norm, x, out_sharding=P("no_such_axis"))
    np.testing.assert_array_equal(y, rms_norm(x, norm.scale.get_value(), EPS))


def test_patched_maxtext_host_offloaded_scale(mt):
    """parameter_memory_host_offload: the scale lives in host memory and is moved to the
    device inside the step (a host operand in the product would not compile)."""
    norm = trained(mt.RMSNorm(64, parameter_memory_host_offload=True, rngs=nnx.Rngs(0)))
    norm.scale.set_value(jax.device_put(norm.scale.get_value(), jax.memory.Space.Host))
    assert norm.scale.get_value().sharding.memory_kind == "pinned_host"
    x = offset_normal((8, 64))
    theirs = call(norm, x)
    logged = len(maxtext_standin.LOGGED)
    with integrations.patch_maxtext(module=mt):
        ours = call(norm, x)
        jaxpr = str(jax.make_jaxpr(lambda x: norm(x))(x))
    assert "device_put" in jaxpr and "MemorySpace.Device" in jaxpr
    if mt is maxtext_standin:
        assert len(maxtext_standin.LOGGED) > logged  # MaxText's log line, as its own call
    np.testing.assert_array_equal(ours, theirs)


# ---------------------------------------------------------------- undo, errors


def test_patch_maxtext_undo_and_idempotence(mt):
    own = mt.RMSNorm.__dict__["__call__"]
    global_own = mt.GlobalRMSNorm.__dict__["__call__"]
    norm = mt.RMSNorm(16, rngs=nnx.Rngs(0))
    x = offset_normal((3, 16))
    with integrations.patch_maxtext(module=mt) as patch:
        assert mt.RMSNorm.__dict__["__call__"] is not own
        assert patch.targets == (f"{mt.__name__}.RMSNorm.__call__",)
    assert mt.RMSNorm.__dict__["__call__"] is own
    assert not uses_ours(norm, x)

    first = integrations.patch_maxtext(module=mt)
    second = integrations.patch_maxtext("xla", module=mt)
    assert mt.RMSNorm.__call__.__rmsnorm_jax_original__ is own  # never wraps
    assert uses_ours(norm, x)
    assert mt.GlobalRMSNorm.__dict__["__call__"] is global_own
    second.undo()
    assert uses_ours(norm, x)  # the first patch's method again
    second.undo()  # twice: nothing more
    assert uses_ours(norm, x)
    integrations.unpatch_maxtext(module=mt)
    assert mt.RMSNorm.__dict__["__call__"] is own
    integrations.unpatch_maxtext(module=mt)  # not patched: a no-op
    first.undo()
    assert mt.RMSNorm.__dict__["__call__"] is own


def test_patch_maxtext_without_maxtext(monkeypatch):
    for name in [m for m in sys.modules if m.split(".")[0] in ("maxtext", "MaxText")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "maxtext", None)
    monkeypatch.setitem(sys.modules, "MaxText", None)
    with pytest.raises(ImportError, match="pip install maxtext"):
        integrations.patch_maxtext()


def test_patch_maxtext_names_a_missing_dependency(tmp_path, monkeypatch):
    package = tmp_path / "fakemaxtext"
    package.mkdir()
    (package / "__init__.py").write_text("import no_such_dependency_of_maxtext\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match="no_such_dependency_of_maxtext"):
        integrations.patch_maxtext(module="fakemaxtext.layers.normalizations")
    with pytest.raises(ImportError, match="no module of that name"):
        integrations.patch_maxtext(module="no_such_package.normalizations")


MAXTEXT_INIT_ARGS = [
    "num_features",
    "epsilon",
    "dtype",
    "weight_dtype",
    "shard_mode",
    "kernel_axes",
    "scale_init",
    "parameter_memory_host_offload",
    "scale_offset",
]


def _fake_normalizations(init_args, call_args):
    """A module whose RMSNorm has the given constructor and call argument names."""
    module = types.ModuleType("fake_normalizations")
    source = textwrap.dedent(
        f"""
        class RMSNorm:
            def __init__(self, {", ".join(f"{a}=None" for a in init_args)}):
                pass

            def __call__(self, {", ".join(call_args)}):
                return x
        """
    )
    exec(source, module.__dict__)
    return module


@pytest.mark.parametrize(
    ("init_args", "call_args", "message"),
    [
        (["num_features", "epsilon", "dtype"], ["x", "out_sharding=None"], "shard_mode"),
        (MAXTEXT_INIT_ARGS, ["x"], r"__call__\(self, x, out_sharding\)"),
        (None, None, "no RMSNorm class"),
    ],
)
def test_patch_maxtext_refuses_an_unknown_shape(init_args, call_args, message):
    if init_args is None:
        module = types.ModuleType("empty_normalizations")
    else:
        module = _fake_normalizations(init_args, call_args)
    with pytest.raises(RuntimeError, match=message):
        integrations.patch_maxtext(module=module)


def test_patch_refuses_an_unknown_implementation():
    with pytest.raises(ValueError, match=r"implementation must be one of .*got 'cuda'"):
        integrations.patch_maxtext("cuda", module=maxtext_standin)
    with pytest.raises(ValueError, match=r"implementation must be one of .*got 'cuda'"):
        integrations.patch_flax("cuda")


def test_import_rmsnorm_jax_imports_no_maxtext():
    code = (
        "import sys, rmsnorm_jax, rmsnorm_jax.integrations\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('maxtext', 'MaxText')]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


# ---------------------------------------------------------------- patch_flax

NNX_OPTIONS = {
    "default": {},
    "dtype_bf16": {"dtype": jnp.bfloat16},
    "param_dtype_bf16": {"param_dtype": jnp.bfloat16},
    "no_scale": {"use_scale": False},
    "scale_init": {"scale_init": nnx.initializers.normal(0.5)},
    "epsilon": {"epsilon": 0.3},
    "slow_variance": {"use_fast_variance": False},
    "two_axes": {"reduction_axes": (-2, -1), "feature_axes": -1},
    "metadata": {"scale_metadata": {"tag": "norm"}},
}


def _nnx_norm(**kw):
    return nnx.RMSNorm(16, rngs=nnx.Rngs(0), **kw)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("options", NNX_OPTIONS.values(), ids=NNX_OPTIONS.keys())
def test_patched_nnx_rmsnorm_is_flaxs(options, dtype):
    x = offset_normal((3, 5, 16), dtype)
    theirs = _nnx_norm(**options)
    y_theirs = call(theirs, x)
    with integrations.patch_flax():
        ours = _nnx_norm(**options)
        assert uses_ours(ours, x)
        y_ours = call(ours, x)
        mask = jnp.arange(16) < 11
        y_masked = nnx.jit(lambda n, x: n(x, mask))(ours, x)
    assert nnx.graphdef(ours) == nnx.graphdef(theirs)
    state_a, state_b = nnx.state(theirs), nnx.state(ours)
    assert jax.tree.map(lambda a: a.dtype, state_a) == jax.tree.map(lambda a: a.dtype, state_b)
    for a, b in zip(jax.tree.leaves(state_a), jax.tree.leaves(state_b), strict=True):
        assert jnp.array_equal(a, b)
    assert y_ours.dtype == y_theirs.dtype
    assert_close(y_ours, y_theirs, **tol(y_theirs.dtype))
    np.testing.assert_allclose(y_masked, call(theirs, x, mask=mask), **tol(y_theirs.dtype))
    if y_theirs.dtype == jnp.float32:  # flax multiplies rsqrt(ms + eps) * scale first
        assert_close(y_ours, y_theirs, rtol=1e-6, atol=1e-6)


LINEN_OPTIONS = {
    "default": {},
    "dtype_bf16": {"dtype": jnp.bfloat16},
    "param_dtype_bf16": {"param_dtype": jnp.bfloat16},
    "no_scale": {"use_scale": False},
    "epsilon": {"epsilon": 0.3},
    "two_axes": {"reduction_axes": (1, 2), "feature_axes": (1, 2)},
    "partitioned": {"scale_init": nn.with_partitioning(nn.initializers.ones, ("embed",))},
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("options", LINEN_OPTIONS.values(), ids=LINEN_OPTIONS.keys())
def test_patched_linen_rmsnorm_is_flaxs(options, dtype):
    layer = nn.RMSNorm(**options)
    x = offset_normal((3, 5, 16), dtype)
    key = jax.random.key(0)
    theirs = layer.init(key, x)
    y_theirs = layer.apply(theirs, x)
    with integrations.patch_flax():
        ours = layer.init(key, x)
        assert uses_ours(lambda x: layer.apply(ours, x), x)
        y_ours = jax.jit(layer.apply)(ours, x)
        mask = jnp.arange(16) < 11
        y_masked = layer.apply(ours, x, mask=mask)
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    leaves = jax.tree.leaves(ours, is_leaf=lambda a: isinstance(a, nn.Partitioned))
    theirs_leaves = jax.tree.leaves(theirs, is_leaf=lambda a: isinstance(a, nn.Partitioned))
    for a, b in zip(leaves, theirs_leaves, strict=True):
        assert type(a) is type(b)
        if isinstance(a, nn.Partitioned):
            assert a.names == b.names
    assert y_ours.dtype == y_theirs.dtype
    assert_close(y_ours, y_theirs, **tol(y_theirs.dtype))
    np.testing.assert_allclose(y_masked, layer.apply(theirs, x, mask=mask), **tol(y_theirs.dtype))


def test_patched_flax_gradients(x64):
    x = offset_normal((4, 6, 16), jnp.float32)
    ct = offset_normal(x.shape, jnp.float32, seed=2)
    norm = _nnx_norm(scale_init=nnx.initializers.normal(0.5), reduction_axes=(-2, -1))
    grads = nnx.grad(lambda n, x: jnp.sum(n(x) * ct), argnums=(0, 1))
    with integrations.patch_flax():
        ours = nnx.jit(grads)(norm, x)
    x64_, s64, ct64 = to64((x, norm.scale[...], ct))
    loss = lambda x, s: jnp.sum(rms_norm_reference(x, s, EPS, axis=(-2, -1)) * ct64)
    dx, dscale = jax.grad(loss, argnums=(0, 1))(x64_, s64)
    assert_close(ours[1], dx, **tol(jnp.float32))
    assert_close(ours[0].scale[...], dscale, **tol(jnp.float32))


def test_patched_flax_axis_name():
    """Features split over "model" under shard_map: the mean square over the whole row."""
    with multi_device_mesh((4, 2), ("data", "model")) as mesh:
        x = offset_normal((8, 32))
        whole = nnx.RMSNorm(32, rngs=nnx.Rngs(0))
        split = nnx.RMSNorm(16, axis_name="model", rngs=nnx.Rngs(0))
        expected = whole(x)

        def apply(x):
            return split(x)

        sharded = jax.shard_map(
            apply, mesh=mesh, in_specs=P("data", "model"), out_specs=P("data", "model")
        )
        with integrations.patch_flax():
            assert uses_ours(sharded, x)
            y = jax.jit(sharded)(x)
        np.testing.assert_allclose(y, expected, rtol=1e-6, atol=1e-6)


def _flax_pair(kind, **options):
    """``(apply(x, **call_kw))`` for an nnx or linen flax RMSNorm with ``options``."""
    if kind == "nnx":
        norm = nnx.RMSNorm(16, rngs=nnx.Rngs(0), **options)
        return lambda x, **kw: norm(x, **kw)
    layer = nn.RMSNorm(**options)
    unmapped = {k: v for k, v in options.items() if k not in ("axis_name", "axis_index_groups")}
    variables = nn.RMSNorm(**unmapped).init(jax.random.key(0), jnp.ones((2, 16)))
    return lambda x, **kw: layer.apply(variables, x, **kw)


@pytest.mark.parametrize("kind", ["nnx", "linen"])
@pytest.mark.parametrize("case", ["complex", "float_mask", "half_reductions"])
def test_patched_flax_falls_back_where_it_cannot_honour(kind, case):
    """A call rms_norm cannot compute as flax does runs flax's own method, bit for bit."""
    x = offset_normal((3, 16), jnp.bfloat16)
    options, call_kw = {}, {}
    if case == "complex":
        x = x.astype(jnp.complex64) * (1 + 0.5j)
    elif case == "float_mask":
        call_kw = {"mask": jnp.linspace(0.0, 1.0, 16)}
    elif kind == "nnx":
        pytest.skip("force_float32_reductions is a linen option")
    else:
        options = {"force_float32_reductions": False}
    apply = _flax_pair(kind, **options)
    try:
        expected = apply(x, **call_kw)
    except ValueError as err:  # NNX refuses a mask that is not boolean: so must we
        with integrations.patch_flax(), pytest.raises(ValueError, match=str(err)[:40]):
            apply(x, **call_kw)
        return
    with integrations.patch_flax():
        assert not uses_ours(lambda x: apply(x, **call_kw), x)
        got = apply(x, **call_kw)
    assert jnp.array_equal(got, expected)


@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_patched_flax_falls_back_for_axis_index_groups(kind):
    devices = devices_for(2)
    x = offset_normal((2, 3, 16))
    apply = _flax_pair(kind, axis_name="d", axis_index_groups=[[0], [1]])
    mapped = lambda x: jax.pmap(apply, axis_name="d", devices=devices)(x)
    expected = mapped(x)
    with integrations.patch_flax():
        got = mapped(x)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_patched_flax_falls_back_for_mask_with_axis_name(kind):
    with multi_device_mesh((4, 2), ("data", "model")) as mesh:
        x = offset_normal((8, 32))
        apply = _flax_pair(kind, axis_name="model")
        mask = jnp.arange(16) < 12

        sharded = jax.jit(
            jax.shard_map(
                lambda x: apply(x, mask=mask),
                mesh=mesh,
                in_specs=P("data", "model"),
                out_specs=P("data", "model"),
            )
        )
        expected = sharded(x)
        with integrations.patch_flax():
            assert not uses_ours(sharded, x)
            got = jax.jit(lambda x: sharded(x))(x)
        np.testing.assert_array_equal(got, expected)


def test_patch_flax_undo():
    own = (nnx.RMSNorm.__dict__["__call__"], nn.RMSNorm.__dict__["__call__"])
    with integrations.patch_flax() as patch:
        assert patch.targets == (
            "flax.nnx.nn.normalization.RMSNorm.__call__",
            "flax.linen.normalization.RMSNorm.__call__",
        )
        integrations.patch_flax()  # again: replaces, never wraps
        norm = _nnx_norm()
        assert uses_ours(norm, jnp.ones((2, 16)))
    assert (nnx.RMSNorm.__dict__["__call__"], nn.RMSNorm.__dict__["__call__"]) == own
    integrations.patch_flax()
    integrations.unpatch_flax()
    assert (nnx.RMSNorm.__dict__["__call__"], nn.RMSNorm.__dict__["__call__"]) == own


# ---------------------------------------------------------------- every patch: checked, counted


def test_patch_counts_the_calls_and_says_when_it_reached_nothing():
    norm = _nnx_norm()
    x = offset_normal((3, 16))
    with integrations.patch_flax() as patch:
        assert patch.calls == 0
        assert "reached nothing" in repr(patch)
        norm(x)  # eager: one call
        jax.jit(lambda x: norm(x) + norm(2 * x))(x)  # one trace, two norm calls
        jax.jit(lambda x: norm(x) + norm(2 * x))(x)  # a new function: traced again
        assert patch.calls == 5
        assert patch.calls_by_target["flax.nnx.nn.normalization.RMSNorm.__call__"] == 5
        assert "5 norm calls through rms_norm" in repr(patch)
        assert "reached nothing" not in repr(patch)
    assert "undone" in repr(patch)


def test_patch_and_undo_drop_earlier_traces():
    """A jitted function traced before the patch runs ours at its next call, and flax's
    again after undo (the patch clears jax's caches both ways)."""
    norm = _nnx_norm(scale_init=nnx.initializers.normal(0.5))
    x = offset_normal((3, 16))
    step = nnx.jit(lambda n, x: n(x))
    theirs = step(norm, x)
    with integrations.patch_flax() as patch:
        ours = step(norm, x)
        assert patch.calls == 1
    assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(step(norm, x), theirs)
    assert patch.calls == 1  # undone: flax's own method ran


def _plus_one(original, implementation, hit):
    """A replacement that computes the wrong formula: ``(1 + scale) * x_hat``."""

    def __call__(self, x, mask=None):
        scale = None if self.scale is None else self.scale[...]
        return rms_norm(x, scale, self.epsilon, axis=self.reduction_axes, scale_offset=1.0)

    return __call__


def _float32_out(original, implementation, hit):
    """A replacement that loses flax's output dtype."""

    def __call__(self, x, mask=None):
        scale = None if self.scale is None else self.scale[...]
        return rms_norm(x, scale, self.epsilon, axis=self.reduction_axes, dtype=jnp.float32)

    return __call__


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (_plus_one, r"float32 outputs differ by \d\.\d+ relative .* more than 1e-06"),
        (_float32_out, r"ours gives .*float32.* where the library gives .*bfloat16"),
    ],
)
def test_patch_refuses_a_replacement_that_differs(monkeypatch, make, message):
    from rmsnorm_jax.integrations import _flax

    own = (nnx.RMSNorm.__dict__["__call__"], nn.RMSNorm.__dict__["__call__"])
    monkeypatch.setattr(_flax, "_nnx_call", make)
    with pytest.raises(RuntimeError, match=r"refused flax\.nnx\.nn\.normalization\.RMSNorm") as err:
        integrations.patch_flax()
    assert err.match(message) and err.match("Nothing was patched")
    assert (nnx.RMSNorm.__dict__["__call__"], nn.RMSNorm.__dict__["__call__"]) == own


def test_patch_maxtext_refuses_a_norm_it_does_not_compute(monkeypatch):
    """A fork whose RMSNorm has MaxText's signature but another formula is refused."""
    module = types.ModuleType("fork_normalizations")
    module.__dict__.update({k: v for k, v in vars(maxtext_standin).items() if k[:2] != "__"})

    class RMSNorm(maxtext_standin.RMSNorm):
        def __call__(self, x, out_sharding=None):
            return 2 * super().__call__(x, out_sharding)

    RMSNorm.__module__, RMSNorm.__qualname__ = module.__name__, "RMSNorm"
    module.RMSNorm = RMSNorm
    with pytest.raises(RuntimeError, match=r"refused fork_normalizations\.RMSNorm: .* differ by"):
        integrations.patch_maxtext(module=module)
    assert not hasattr(RMSNorm.__dict__["__call__"], "__rmsnorm_jax_original__")


@pytest.mark.parametrize(
    ("patch", "package", "install"),
    [
        ("patch_tunix", "tunix", "pip install google-tunix"),
        ("patch_gemma", "gemma", "pip install gemma"),
        ("patch_equinox", "equinox", "pip install equinox"),
        ("patch_keras", "keras", "pip install keras"),
    ],
)
def test_patch_of_a_library_not_installed_says_how_to_install(monkeypatch, patch, package, install):
    for name in [m for m in sys.modules if m.split(".")[0] == package]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, package, None)
    with pytest.raises(ImportError, match=install):
        getattr(integrations, patch)()


def test_import_rmsnorm_jax_imports_no_client_library():
    code = (
        "import sys, rmsnorm_jax, rmsnorm_jax.integrations\n"
        "found = [m for m in sys.modules if m.split('.')[0] in "
        "('tunix', 'gemma', 'equinox', 'keras', 'keras_hub', 'maxtext', 'MaxText')]\n"
        "assert not found, found\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
