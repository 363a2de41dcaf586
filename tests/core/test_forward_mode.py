"""Forward mode (jvp, jacfwd, linearize, hessian) through every norm, and the reverse mode
it must leave as it was: the analytic backward rule, its residuals, second order.

Oracles: the plain formula (``rmsnorm_jax.reference``) under jax's own autodiff in
float64, numerical derivatives (``check_grads``), and the adjoint identity
``<dy, T(dx, dp)> == <B(dy), (dx, dp)>`` between the tangent map T and the backward B.
"""

import contextlib
import functools
import io

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx
from helpers import multi_device_mesh, offset_normal
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import rmsnorm_jax
import rmsnorm_jax.nnx
from rmsnorm_jax import add_rms_norm, gated_rms_norm, rms_norm
from rmsnorm_jax.reference import rms_norm_reference

pytestmark = pytest.mark.newest

F64 = dict(rtol=1e-10, atol=1e-10)

OPTIONS = {
    "plain": dict(),
    "p": dict(p=0.4),
    "scale_offset": dict(scale_offset=1.0),
    "outside": dict(eps_placement="outside", eps=1e-3),
    "bias": dict(bias=True),
    "mask": dict(mask=True),
    "two_axes": dict(axis=(-2, -1)),
    "unit_axes": dict(shape=(1, 4, 1, 6), p=0.5),  # dropped by the core (a batch of one)
}


def _inputs(shape=(3, 4, 6), seed=0, dtype=jnp.float64):
    x = offset_normal(shape, dtype, seed)
    scale = offset_normal(shape[-1:], dtype, seed + 1)
    bias = offset_normal(shape[-1:], dtype, seed + 2)
    mask = jax.random.bernoulli(jax.random.key(seed + 3), 0.6, shape)
    return x, scale, bias, mask


def _kwargs(option, bias, mask):
    kw = dict(OPTIONS[option])
    kw.pop("shape", None)
    kw["bias"] = bias if kw.pop("bias", False) else None
    kw["mask"] = mask if kw.pop("mask", False) else None
    return kw


def _gated_oracle(x, gate, scale, bias, *, activation, norm_before_gate):
    act = jax.nn.silu(gate) if activation == "silu" else jax.nn.sigmoid(gate)
    if norm_before_gate:
        return rms_norm_reference(x, scale, 1e-6, bias=bias) * act
    return rms_norm_reference(x * act, scale, 1e-6, bias=bias)


# ---------------------------------------------------------------- against the formula


@pytest.mark.parametrize("option", list(OPTIONS))
def test_jvp_and_jacfwd_equal_the_plain_formula(x64, option):
    x, scale, bias, mask = _inputs(OPTIONS[option].get("shape", (3, 4, 6)))
    kw = _kwargs(option, bias, mask)
    b = kw.pop("bias")

    def ours(x, scale, b):
        return rms_norm(x, scale, bias=b, **kw)

    def formula(x, scale, b):
        return rms_norm_reference(x, scale, bias=b, **kw)

    primals = (x, scale, b)
    tangents = tuple(None if a is None else offset_normal(a.shape, a.dtype, 7) for a in primals)
    chex.assert_trees_all_close(
        jax.jvp(ours, primals, tangents), jax.jvp(formula, primals, tangents), **F64
    )
    argnums = (0, 1) if b is None else (0, 1, 2)
    chex.assert_trees_all_close(
        jax.jacfwd(ours, argnums)(*primals), jax.jacfwd(formula, argnums)(*primals), **F64
    )


def test_residual_form_jvp_equals_the_plain_formula(x64):
    x, scale, bias, mask = _inputs()
    r = offset_normal(x.shape, x.dtype, 5)

    def ours(x, r, scale, bias):
        return add_rms_norm(x, r, scale, bias=bias, mask=mask)

    def formula(x, r, scale, bias):
        h = x + r
        return rms_norm_reference(h, scale, bias=bias, mask=mask), h

    primals = (x, r, scale, bias)
    tangents = tuple(offset_normal(a.shape, a.dtype, 11 + i) for i, a in enumerate(primals))
    chex.assert_trees_all_close(
        jax.jvp(ours, primals, tangents), jax.jvp(formula, primals, tangents), **F64
    )
    # A tangent on one input only (symbolic zeros elsewhere).
    only_r = (jnp.zeros_like(x), tangents[1], jnp.zeros_like(scale), jnp.zeros_like(bias))
    chex.assert_trees_all_close(
        jax.jvp(ours, primals, only_r), jax.jvp(formula, primals, only_r), **F64
    )


@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_gated_form_jvp_equals_the_plain_formula(x64, activation, norm_before_gate):
    x, scale, bias, _ = _inputs()
    gate = offset_normal(x.shape, x.dtype, 5)
    kw = dict(activation=activation, norm_before_gate=norm_before_gate)

    def ours(x, gate, scale, bias):
        return gated_rms_norm(x, gate, scale, bias=bias, **kw)

    primals = (x, gate, scale, bias)
    tangents = tuple(offset_normal(a.shape, a.dtype, 11 + i) for i, a in enumerate(primals))
    chex.assert_trees_all_close(
        jax.jvp(ours, primals, tangents),
        jax.jvp(functools.partial(_gated_oracle, **kw), primals, tangents),
        **F64,
    )


def test_jvp_with_features_split_over_a_mesh_axis(x64):
    """axis_name: the tangent's row sum is summed across the devices too."""
    x, scale, _, _ = _inputs((4, 16))
    dx, dscale = offset_normal(x.shape, x.dtype, 9), offset_normal(scale.shape, x.dtype, 10)

    def local(x, scale, dx, dscale):
        return jax.jvp(
            lambda x, s: rms_norm(x, s, p=0.3, axis_name="model"), (x, scale), (dx, dscale)
        )

    specs = (P("data", "model"), P("model"), P("data", "model"), P("model"))
    with multi_device_mesh((2, 4), ("data", "model")) as mesh:
        sharded = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=specs[:1] * 2)
        got = jax.jit(sharded)(x, scale, dx, dscale)
    want = jax.jvp(lambda x, s: rms_norm_reference(x, s, p=0.3), (x, scale), (dx, dscale))
    chex.assert_trees_all_close(got, want, **F64)


# ---------------------------------------------------------------- adjoint identity


@pytest.mark.parametrize("option", list(OPTIONS))
def test_backward_is_the_transpose_of_the_tangent_map(x64, option):
    """<dy, T(dx, dscale, dbias)> == <B(dy), (dx, dscale, dbias)>: T by jax.jvp, B by
    jax.vjp (the analytic backward rule), random inputs."""
    x, scale, bias, mask = _inputs(OPTIONS[option].get("shape", (3, 4, 6)), seed=3)
    kw = _kwargs(option, bias, mask)
    b = kw.pop("bias")
    f = functools.partial(lambda x, s, b: rms_norm(x, s, bias=b, **kw))
    primals = (x, scale, b)
    tangents = tuple(None if a is None else offset_normal(a.shape, a.dtype, 20) for a in primals)
    dy = offset_normal(x.shape, x.dtype, 30)
    _, t = jax.jvp(f, primals, tangents)
    _, vjp = jax.vjp(f, *primals)
    cotangents = vjp(dy)
    lhs = jnp.vdot(dy, t)
    rhs = sum(jnp.vdot(c, d) for c, d in zip(cotangents, tangents, strict=True) if d is not None)
    np.testing.assert_allclose(lhs, rhs, rtol=1e-12)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, r, s, b: add_rms_norm(x, r, s, bias=b, p=0.5),
        lambda x, r, s, b: (gated_rms_norm(x, r, s, bias=b),),
        lambda x, r, s, b: (gated_rms_norm(x, r, s, bias=b, norm_before_gate=False),),
    ],
    ids=["add", "gated", "gate_then_norm"],
)
def test_fused_backward_is_the_transpose_of_the_tangent_map(x64, fn):
    x, scale, bias, _ = _inputs(seed=4)
    primals = (x, offset_normal(x.shape, x.dtype, 8), scale, bias)
    tangents = tuple(offset_normal(a.shape, a.dtype, 40 + i) for i, a in enumerate(primals))
    outs, t = jax.jvp(fn, primals, tangents)
    cts = tuple(offset_normal(o.shape, o.dtype, 50 + i) for i, o in enumerate(outs))
    _, vjp = jax.vjp(fn, *primals)
    lhs = sum(jnp.vdot(c, ti) for c, ti in zip(cts, t, strict=True))
    rhs = sum(jnp.vdot(c, d) for c, d in zip(vjp(cts), tangents, strict=True))
    np.testing.assert_allclose(lhs, rhs, rtol=1e-12)


# ---------------------------------------------------------------- numerical derivatives


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, r, s, b: rms_norm(x, s, bias=b, p=0.5),
        lambda x, r, s, b: rms_norm(x, s, scale_offset=1.0, eps_placement="outside", eps=1e-2),
        lambda x, r, s, b: add_rms_norm(x, r, s, bias=b),
        lambda x, r, s, b: gated_rms_norm(x, r, s, bias=b),
    ],
    ids=["rms_norm", "outside", "add", "gated"],
)
def test_check_grads_both_modes_second_order(x64, fn):
    x, scale, bias, _ = _inputs((2, 5))
    args = (x, offset_normal(x.shape, x.dtype, 8), scale, bias)
    check_grads(fn, args, order=2, modes=("fwd", "rev"))


# ---------------------------------------------------------------- the kernels


@pytest.mark.parametrize("form", ["rms_norm", "add"])
def test_pallas_forward_and_second_order_equal_xla(form):
    """implementation="pallas" (interpret mode here): forward mode around the kernel's
    output, and grad-of-grad / hessian through the XLA twin of the kernel backward."""
    x, scale, bias, _ = _inputs((4, 128), dtype=jnp.float32)
    r = offset_normal(x.shape, x.dtype, 5)

    def f(impl):
        if form == "rms_norm":
            return lambda x, s: rms_norm(x, s, bias=bias, implementation=impl)
        return lambda x, s: add_rms_norm(x, r[: x.shape[0]], s, bias=bias, implementation=impl)[0]

    tangents = (offset_normal(x.shape, x.dtype, 9), offset_normal(scale.shape, x.dtype, 10))
    close = dict(rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(
        jax.jvp(f("pallas"), (x, scale), tangents), jax.jvp(f("xla"), (x, scale), tangents), **close
    )

    def hessian(impl):
        return jax.hessian(lambda s: jnp.sum(jnp.sin(f(impl)(x[:2], s))))(scale)

    chex.assert_trees_all_close(hessian("pallas"), hessian("xla"), **close)


def test_pallas_gradient_runs_the_kernel_backward(monkeypatch):
    """Reverse mode transposes the tangent map into the kernel backward: lowering the
    gradient calls the backward kernel (interpret mode here); forward mode does not."""
    from rmsnorm_jax.kernels import triton as gpu

    calls = []
    original = gpu.backward
    monkeypatch.setattr(gpu, "backward", lambda *a, **k: calls.append(1) or original(*a, **k))
    x, scale, *_ = _inputs((4, 128), dtype=jnp.float32)

    def norm(x, s):
        return rms_norm(x, s, implementation="pallas")

    jax.jit(lambda x, s, dx: jax.jvp(norm, (x, s), (dx, s))).lower(x, scale, x)
    assert not calls
    jax.jit(jax.grad(lambda x, s: jnp.sum(norm(x, s)), (0, 1))).lower(x, scale)
    assert calls


# ---------------------------------------------------------------- reverse mode kept


def test_gradient_runs_the_analytic_backward_rule(monkeypatch, x64):
    """jax.grad calls backward_parts (it is not autodiff of the forward), and jax.jvp
    does not."""
    calls = []
    from rmsnorm_jax._xla import rms_norm as xla_rms_norm

    original = xla_rms_norm.backward_parts
    monkeypatch.setattr(xla_rms_norm, "backward_parts", lambda *a: calls.append(1) or original(*a))
    x, scale, *_ = _inputs()
    jax.jvp(lambda x: rms_norm(x, scale), (x,), (x,))
    assert not calls
    jax.grad(lambda x: jnp.sum(rms_norm(x, scale) ** 2))(x)
    assert calls


def _saved(fn, *args):
    """What ``jax.ad_checkpoint.print_saved_residuals`` prints: (type, what it is)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(fn, *args)
    lines = out.getvalue().strip().splitlines()
    return sorted((line.split(" ")[0], line.split(" ", 1)[1].split(" from /")[0]) for line in lines)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_saved_residuals_are_x_scale_and_one_float_per_row(implementation):
    x = offset_normal((8, 128), jnp.bfloat16)
    scale = offset_normal((128,), jnp.float32, 1)
    saved = _saved(lambda x, s: rms_norm(x, s, implementation=implementation), x, scale)
    assert saved == [
        ("bf16[8,128]", "from the argument x"),
        ("f32[128]", "from the argument s"),
        ("f32[8,1]", "named 'rms_norm_stat'"),
    ]
    r = offset_normal((8, 128), jnp.bfloat16, 2)
    saved = _saved(lambda x, s: add_rms_norm(x, r, s, implementation=implementation), x, scale)
    assert [a for a, _ in saved] == ["bf16[8,128]", "f32[128]", "f32[8,1]"]


# ---------------------------------------------------------------- transformations


def test_transformations_compose(x64):
    """jit, vmap, scan and checkpoint around jvp, jacfwd, linearize, jvp-of-grad and
    jacfwd(jacrev), each against the plain formula."""
    x, scale, *_ = _inputs((3, 6))
    dx = offset_normal(x.shape, x.dtype, 3)

    def run(norm):
        def layer(h, _):
            return jax.checkpoint(norm)(h) * 1.5, None

        def stack(x):
            return jax.lax.scan(layer, x, None, length=2)[0]

        loss = lambda x: jnp.sum(jnp.sin(stack(x)))
        y, linear = jax.linearize(stack, x)
        return (
            jax.jit(lambda x, dx: jax.jvp(stack, (x,), (dx,)))(x, dx),
            jax.vmap(lambda x, dx: jax.jvp(stack, (x,), (dx,)))(x, dx),
            (y, linear(dx)),
            jax.jvp(jax.grad(loss), (x,), (dx,)),
            jax.jacfwd(jax.jacrev(loss))(x),
            jax.vmap(jax.grad(lambda r: jnp.sum(jnp.sin(norm(r)))))(x),
        )

    got = run(lambda x: rms_norm(x, scale, p=0.5))
    want = run(lambda x: rms_norm_reference(x, scale, p=0.5))
    chex.assert_trees_all_close(got, want, **F64)


def test_modules_support_forward_mode(x64):
    x = offset_normal((2, 8), jnp.float64)
    dx = offset_normal((2, 8), jnp.float64, 1)
    layer = rmsnorm_jax.RMSNorm(param_dtype=jnp.float64)
    params = layer.init(jax.random.key(0), x)
    got = jax.jvp(lambda x: layer.apply(params, x), (x,), (dx,))
    want = jax.jvp(lambda x: linen.RMSNorm(param_dtype=jnp.float64).apply(params, x), (x,), (dx,))
    chex.assert_trees_all_close(got, want, **F64)

    ours = rmsnorm_jax.nnx.RMSNorm(8, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    theirs = nnx.RMSNorm(8, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    chex.assert_trees_all_close(
        jax.jvp(lambda x: ours(x), (x,), (dx,)), jax.jvp(lambda x: theirs(x), (x,), (dx,)), **F64
    )


@pytest.mark.skipif(not hasattr(nnx, "jvp"), reason="this flax has no nnx.jvp")
@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_nnx_jvp_through_the_module_and_its_scale(x64, implementation):
    """flax's ``nnx.jvp`` with tangents on the module (its scale) and on x, against flax's
    own ``nnx.RMSNorm`` holding the same scale."""
    x = offset_normal((2, 8), jnp.float64)
    dx = offset_normal((2, 8), jnp.float64, 1)
    dscale = offset_normal((8,), jnp.float64, 2)

    def run(cls, **kw):
        layer = cls(8, param_dtype=jnp.float64, rngs=nnx.Rngs(0), **kw)
        layer.scale[...] = offset_normal((8,), jnp.float64, 3)
        tangent = jax.tree.map(jnp.zeros_like, layer)
        tangent.scale[...] = dscale
        return nnx.jvp(lambda m, x: m(x), (layer, x), (tangent, dx), graph=False)

    got = run(rmsnorm_jax.nnx.RMSNorm, implementation=implementation)
    chex.assert_trees_all_close(got, run(nnx.RMSNorm), **F64)
    assert float(jnp.abs(got[1]).max()) > 0.1  # the tangent carries dscale and dx


# ---------------------------------------------------------------- compiled programs kept

# Compiled with the custom_vjp core of commit cc82453 (before forward mode) and with this
# one, jax 0.10.2 (libtpu 0.0.42.1, CUDA plugin 0.10.2), deviceless: identical. Keyed by
# (target, program): (temp bytes, kernels) of the Gemma-3-style step (models.SMALL,
# batch 2 x 64), and temp bytes of the uniform pre-norm step (d 512, 4096 tokens).
# The H100 Gemma steps were (2569688, 202) and (1985312, 172) until the XLA path formed
# ``scale + 1`` once on GPU as everywhere (issue 34: ``a * scale + a`` lost accuracy where
# ``1 + scale`` is near 0); the backward traced inline at its transpose (the same issue)
# changed no program.
RECORDED_JAX = "0.10.2"
RECORDED = {
    ("h100", "gemma scan"): (2537944, 203),
    ("h100", "gemma unrolled"): (2001696, 174),
    ("tpu-v5e", "gemma scan"): (3870720, 186),
    ("tpu-v5e", "gemma unrolled"): (0, 175),
    ("h100", "uniform relu"): 470583736,
    ("h100", "uniform swiglu"): 881626088,
    ("tpu-v5e", "uniform relu"): 370647040,
    ("tpu-v5e", "uniform swiglu"): 825121792,
}


@pytest.mark.parametrize("target_name", ["h100", "tpu-v5e"])
def test_compiled_train_steps_unchanged_by_forward_mode(target_name):
    """Forward mode changed no reverse-mode program: the Gemma-3-style step and the
    uniform step compile to the temp memory and kernel counts recorded before it."""
    if jax.__version__ != RECORDED_JAX:
        pytest.skip(f"recorded with jax {RECORDED_JAX}; this is jax {jax.__version__}")

    from helpers import aot_target

    target = aot_target(target_name)
    from benchmarks import estimates, models

    for mode in ("scan", "unrolled"):
        record, _ = estimates.gemma_step(target, models.SMALL, "rms_norm", mode, 2, 64)
        got = (record["temp_bytes"], record["kernels"])
        assert got == RECORDED[(target_name, f"gemma {mode}")], (mode, got)
    memory = estimates.train_step_memory(
        target, ("rms_norm", "flax RMSNorm"), d=512, tokens=4096, mlps=("relu", "swiglu")
    )
    for r in memory:
        if r["norm"] == "rms_norm":
            assert r["temp_bytes"] == RECORDED[(target_name, f"uniform {r['mlp']}")], r
