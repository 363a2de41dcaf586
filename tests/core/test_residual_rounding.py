"""One rounding rule for the residual form: ``h = x + residual`` is rounded to its dtype
once, and ``y``, the statistic and the backward all read that rounded ``h``.

Oracles: NumPy's own float16/bfloat16 conversions (``ml_dtypes``) for the rounding, and
``rms_norm`` applied to the ``h`` that ``add_rms_norm`` returned (bitwise on XLA:CPU),
or the float64 formula on that ``h`` (the kernels, within one ulp). Before the rule,
XLA's excess precision normalized the unrounded float32 sum: ``y`` was up to 1.4e-2
away from ``rms_norm(h)`` at bfloat16, and a float16 row of subnormals gave NaN in the
GPU kernel's interpret mode.
"""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import aot_target, assert_close, kernel_spec, on_host_cpu
from jax.sharding import PartitionSpec as P

from rmsnorm_jax import add_rms_norm, aot, rms_norm
from rmsnorm_jax._rounding import pinned, rounded
from rmsnorm_jax.kernels import mosaic_tpu, triton

NUMPY_DTYPE = {jnp.float16: np.float16, jnp.bfloat16: ml_dtypes.bfloat16}

# (x dtype, residual dtype, residual_dtype): h narrower than float32 in all but the last.
MIXES = [
    (jnp.bfloat16, jnp.bfloat16, None),
    (jnp.float32, jnp.bfloat16, jnp.bfloat16),
    (jnp.bfloat16, jnp.float32, jnp.bfloat16),
    (jnp.float16, jnp.float16, None),
    (jnp.float32, jnp.float32, jnp.float16),
    (jnp.bfloat16, jnp.bfloat16, jnp.float32),
]


def _mix_id(mix):
    return "-".join("default" if d is None else str(jnp.dtype(d)) for d in mix)


def _float32_patterns(seed=0):
    """Float32 bit patterns: random ones, every pattern of the low 24 bits (ties and the
    float16/bfloat16 subnormals among them), and random ones with the exponents around
    float16's range, both signs."""
    rng = np.random.default_rng(seed)
    low = np.arange(0, 2**24, 7, dtype=np.uint32)
    exps = rng.integers(100, 146, size=1 << 20).astype(np.uint32) << 23
    near = exps | rng.integers(0, 2**23, size=1 << 20).astype(np.uint32)
    random = rng.integers(0, 2**32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    bits = np.concatenate([low, near, random])
    bits = np.concatenate([bits, bits | np.uint32(1 << 31)])
    return bits.view(np.float32)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_rounded_is_numpys_conversion_bit_for_bit(dtype):
    v = _float32_patterns()
    with np.errstate(over="ignore", invalid="ignore"):  # overflow to inf is part of it
        want = v.astype(NUMPY_DTYPE[dtype]).astype(np.float32)
    for f in (jax.jit(lambda v: rounded(v, dtype)), lambda v: rounded(v, dtype)):
        got = np.asarray(f(jnp.asarray(v)))
        same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
        assert same.all(), (v[~same][:4], got[~same][:4], want[~same][:4])


def test_rounded_and_pinned_leave_float32_alone():
    v = jnp.asarray(_float32_patterns()[:1000])
    assert rounded(v, jnp.float32) is v
    assert pinned(v) is v


def _inputs(mix, rows=32, n=384, seed=0):
    xd, rd, hd = mix
    kx, kr, ks, kb = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(kx, (rows, n)).astype(xd)
    r = (3 * jax.random.normal(kr, (rows, n))).astype(rd)
    s = 1 + 0.2 * jax.random.normal(ks, (n,))
    b = 0.1 * jax.random.normal(kb, (n,))
    return x, r, s, b, hd


@pytest.mark.parametrize("mix", MIXES, ids=_mix_id)
@pytest.mark.parametrize(
    "options",
    [dict(), dict(p=0.5, eps_placement="outside"), dict(scale_offset=1.0), dict(dtype=None)],
    ids=["plain", "partial-outside", "offset", "out-dtype-default"],
)
def test_xla_path_normalizes_the_h_it_returns_bitwise(mix, options):
    x, r, s, b, hd = _inputs(mix)
    options = dict(dict(dtype=jnp.float32), **options)

    # Two programs: in one, XLA would feed rms_norm the same unrounded sum.
    y, h = jax.jit(lambda x, r: add_rms_norm(x, r, s, bias=b, residual_dtype=hd, **options))(x, r)
    expected = jax.jit(lambda h: rms_norm(h, s, bias=b, **options))(h)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(expected))


@pytest.mark.parametrize("mix", MIXES[:5], ids=_mix_id)
def test_xla_path_backward_pairs_the_rounded_h_with_its_statistic(mix):
    """The scale gradient equals that of ``rms_norm`` at the returned ``h``. (XLA:CPU
    kept this one even before the rule: the gradient program reads the saved ``h``.)"""
    x, r, s, b, hd = _inputs(mix, seed=1)
    w = jax.random.normal(jax.random.key(9), x.shape)

    def loss_fused(s, x, r):
        y, h = add_rms_norm(x, r, s, bias=b, residual_dtype=hd, dtype=jnp.float32)
        return jnp.sum(y * w) + jnp.sum(h.astype(jnp.float32) * w)

    h = jax.jit(lambda x, r: add_rms_norm(x, r, s, residual_dtype=hd)[1])(x, r)

    def loss_split(s, h):
        y = rms_norm(h, s, bias=b, dtype=jnp.float32)
        return jnp.sum(y * w) + jnp.sum(h.astype(jnp.float32) * w)

    ds = jax.jit(jax.grad(loss_fused))(s, x, r)
    ds_split = jax.jit(jax.grad(loss_split))(s, h)
    assert_close(ds, ds_split, rtol=1e-6, atol=1e-6)


KERNELS = {
    "gpu": lambda spec, x, s, r, hd: triton.forward(
        spec, x, s, None, r, h_dtype=hd, interpret=True
    ),
    "tpu": lambda spec, x, s, r, hd: mosaic_tpu.forward(
        spec, x, s, None, r, h_dtype=hd, interpret=True
    ),
}


PLAIN = {
    "gpu": lambda spec, h, s: triton.forward(spec, h, s, None, interpret=True),
    "tpu": lambda spec, h, s: mosaic_tpu.forward(spec, h, s, None, interpret=True),
}


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("mix", MIXES[:5], ids=_mix_id)
def test_kernels_normalize_the_h_they_write(kernel, mix):
    """Interpret mode (the kernel bodies as XLA ops, where excess precision would apply):
    ``y`` and the statistic are bitwise the same kernel's plain form on the ``h`` it
    wrote, and the statistic is that of ``h`` to float32 rounding (an unrounded sum
    misses it by up to 2e-3 at bfloat16)."""
    # Bitwise: two XLA:CPU programs round alike. XLA:GPU need not (on an H200, 933 of
    # 4096 values 1 ulp apart): the claim is about interpret mode on XLA:CPU.
    with on_host_cpu("interpret mode's bitwise equalities are XLA:CPU's"):
        x, r, s, _, hd = _inputs(mix, rows=16, n=256, seed=2)
        hd = hd or jnp.promote_types(x.dtype, r.dtype)
        spec = kernel_spec(x.shape[1], jnp.float32, bias=False)
        y, stat, h = jax.jit(lambda x, r: KERNELS[kernel](spec, x, s, r, hd))(x, r)
        y_plain, stat_plain, _ = jax.jit(lambda h: PLAIN[kernel](spec, h, s))(h)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_plain))
    np.testing.assert_array_equal(np.asarray(stat), np.asarray(stat_plain))
    h64 = np.asarray(h, np.float64)
    stat64 = 1 / np.sqrt(np.mean(h64**2, axis=1) + spec.eps)
    np.testing.assert_allclose(np.asarray(stat), stat64, rtol=1e-6)
    # The kernel and the XLA path sum in different orders: both are 2-3 float32 ulps
    # from the float64 formula here, and from each other.
    y64 = stat64[:, None] * h64 * np.asarray(s, np.float64)
    np.testing.assert_array_max_ulp(np.asarray(y), y64.astype(np.float32), maxulp=4)


def _subnormal_rows():
    """Two float16 rows of 2e-5 * N(0, 1): every element below float16's smallest normal
    (6.1e-5) or nearly so, most of them subnormal."""
    x = (2e-5 * jax.random.normal(jax.random.key(3), (2, 64))).astype(jnp.float16)
    assert (np.abs(np.asarray(x, np.float64)) < 6.1e-5).mean() > 0.9
    return x


def _formula(h):
    h64 = np.asarray(h, np.float64)
    return h64 / np.sqrt(np.mean(h64**2, axis=1, keepdims=True))


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_float16_subnormal_rows_are_finite_where_the_formula_is(implementation):
    x = _subnormal_rows()
    y, h = add_rms_norm(
        x, jnp.zeros_like(x), eps=0.0, dtype=jnp.float32, implementation=implementation
    )
    np.testing.assert_allclose(np.asarray(y), _formula(h), rtol=1e-5)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_float16_subnormal_rows_in_the_kernels(kernel):
    x = _subnormal_rows()
    spec = kernel_spec(x.shape[1], jnp.float32, eps=0.0, bias=False)
    y, _, h = KERNELS[kernel](spec, x, jnp.ones(x.shape[1]), jnp.zeros_like(x), jnp.float16)
    np.testing.assert_allclose(np.asarray(y), _formula(h), rtol=1e-5)


@pytest.mark.parametrize("mix", MIXES[:5], ids=_mix_id)
def test_h100_normalizes_the_h_it_wrote(mix):
    """XLA:GPU gets the plain sum (``_backends.residual_sum``): the rule holds there
    because one kernel writes ``h`` and the normalisation reads that array back
    (deviceless H100 compile), rather than recomputing ``h`` from both inputs."""
    target = aot_target("h100")
    mesh = target.mesh((1,), ("d",))
    xd, rd, hd = mix
    x = aot.struct((1024, 1024), xd, mesh, P())
    r = aot.struct((1024, 1024), rd, mesh, P())
    s = aot.struct((1024,), jnp.float32, mesh, P())
    f = jax.jit(lambda x, r, s: add_rms_norm(x, r, s, residual_dtype=hd, dtype=jnp.float32))
    entry = target.compile(f, x, r, s).as_text().split("\nENTRY ", 1)[1]
    y_name, h_name = re.search(r"ROOT \S+ = .*? tuple\((%\S+), (%\S+)\)", entry).groups()
    y_line = next(line for line in entry.splitlines() if line.strip().startswith(y_name + " "))
    operands = re.search(r"\bfusion\(([^)]*)\)", y_line).group(1)
    assert h_name in operands.split(", "), (y_line, h_name)
