"""The Mosaic GPU kernels (``rmsnorm_jax/kernels/mosaic_gpu.py``) against the float64 oracle.

On a CPU the kernels run in Mosaic GPU interpret mode (the same kernel bodies, shared
memory, TMA copies and barriers, on the CPU); on a GPU backend they run compiled. The
oracle is ``rms_norm_reference`` in float64 under ``jax.vjp`` on the same input values.
A deviceless H100 compile checks that each kernel is one Mosaic GPU call, that ptxas
spills no register, and that the plan's shared memory is what Mosaic allocates.
"""

import dataclasses
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import aot_target, assert_close, to64, tol
from helpers import kernel_spec as _spec
from jax.sharding import PartitionSpec as P

from rmsnorm_jax import aot
from rmsnorm_jax.kernels import mosaic_gpu
from rmsnorm_jax.reference import rms_norm_reference

pytestmark = pytest.mark.skipif(
    not mosaic_gpu.available(),
    reason=f"the Mosaic GPU kernels need jax >= 0.11.2 (plgpu.kernel and its interpret "
    f"mode, InterpretGPUParams); this is jax {jax.__version__}",
)
INTERPRET = jax.default_backend() != "gpu"
EPS = 1e-5


def _race_checked():
    """Interpret mode with the interpreter's happens-before race detector (raising at the
    first race: the kernels synchronize TMA copies, rings and slots by hand; jax >= 0.12),
    or the GPU."""
    if not INTERPRET:
        return False
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if "on_race" not in {f.name for f in dataclasses.fields(plgpu.InterpretGPUParams)}:
        return True  # jax 0.11's detector prints a race and carries on: not a check
    return plgpu.InterpretGPUParams(detect_races=True, on_race="raise")


def _inputs(rows, n, dtype, seed=0, param_dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 4)
    x = (2.0 * jax.random.normal(keys[0], (rows, n))).astype(dtype)
    scale = (1.0 + 0.3 * jax.random.normal(keys[1], (n,))).astype(param_dtype)
    bias = (0.1 * jax.random.normal(keys[2], (n,))).astype(param_dtype)
    dy = jax.random.normal(keys[3], (rows, n)).astype(dtype)
    return x, scale, bias, dy


def _oracle(spec, x, scale, bias, dy):
    """Float64 y, stat and (dx, dscale, dbias) of sum(y * dy), by autodiff."""
    x, scale, bias, dy = to64((x, scale, bias, dy))
    placement = "inside" if spec.inside else "outside"
    kw = dict(eps=spec.eps, k=spec.k, scale_offset=spec.scale_offset, eps_placement=placement)

    def f(x, scale, bias):
        return rms_norm_reference(x, scale, bias=bias, **kw)

    y, vjp = jax.vjp(f, x, scale, bias)
    ms = jnp.mean(x[:, : spec.k] ** 2, axis=1)
    stat = 1 / jnp.sqrt(ms + spec.eps) if spec.inside else jnp.sqrt(ms)
    return y, stat, vjp(dy)


def _run(spec, x, scale, bias, dy, interpret=INTERPRET):
    scale = scale if spec.has_scale else None
    bias = bias if spec.has_bias else None
    y, stat, h = mosaic_gpu.forward(spec, x, scale, bias, interpret=interpret)
    assert h is None
    dx, dscale, dbias = mosaic_gpu.backward(
        spec, x, dy, stat, scale, dx_dtype=x.dtype, interpret=interpret
    )
    return y, stat, dx, dscale, dbias


def _check(spec, dtype, x, scale, bias, dy, got):
    y, stat, dx, dscale, dbias = got
    scale = scale if spec.has_scale else None
    bias = bias if spec.has_bias else None
    assert (y.dtype, stat.dtype, dx.dtype) == (spec.out_dtype, jnp.float32, x.dtype)
    assert y.shape == dx.shape == x.shape and stat.shape == x.shape[:1]
    with jax.enable_x64(True):
        y_o, stat_o, (dx_o, dscale_o, dbias_o) = _oracle(spec, x, scale, bias, dy)
        assert_close(y, y_o, **tol(dtype))
        assert_close(stat, stat_o, **tol(jnp.float32))
        assert_close(dx, dx_o, **tol(dtype))
        # The partial sums are float32 whatever the input dtype: float32 tolerances
        # against the oracle on the same (rounded) inputs.
        for present, got_sum, want in (
            (spec.has_scale, dscale, dscale_o),
            (spec.has_bias, dbias, dbias_o),
        ):
            if present:
                assert got_sum.dtype == jnp.float32 and got_sum.shape[1:] == (spec.n,)
                assert_close(got_sum.sum(0), want, **tol(jnp.float32))
            else:
                assert got_sum is None


# QK-norm's 64 and 128 features (row tiles of 16-32 rows), 256, 1000 (odd splits of 200:
# 2-byte vectors), 4096 (one row a block, split in 16); rows that leave the last block
# partial. Every width in bfloat16, some in float32 and float16 (each shape is a new
# interpret-mode compile, seconds on a CPU). 1000 features float32 with both sums do not
# fit (test_fits): no bias at 1000.
_BF16 = [
    (jnp.bfloat16, rows, n) for rows, n in [(37, 64), (37, 128), (19, 256), (13, 1000), (3, 4096)]
]
_F32 = [(jnp.float32, rows, n) for rows, n in [(37, 64), (13, 1000), (3, 4096)]]
_F16 = [(jnp.float16, rows, n) for rows, n in [(37, 128), (19, 256)]]


@pytest.mark.parametrize("dtype, rows, n", _BF16 + _F32 + _F16)
def test_forward_and_backward_match_the_float64_formula(dtype, rows, n):
    spec = _spec(n, dtype, bias=n != 1000)
    x, scale, bias, dy = _inputs(rows, n, dtype)
    plan = mosaic_gpu.plan(spec, rows, dtype, "forward")
    assert plan.split == (n == 4096) and (rows % plan.R or plan.split)
    _check(spec, dtype, x, scale, bias, dy, _run(spec, x, scale, bias, dy))


def test_wide_rows_staged_forward_and_streamed_backward():
    """16384 features float32: the forward stages the row (two chunks per pass), the
    backward's two sums leave no room for the row: streamed. Free of data races."""
    spec = _spec(16384, jnp.float32, offset=1.0)
    x, scale, bias, dy = _inputs(3, 16384, jnp.float32, seed=8)
    assert not mosaic_gpu.plan(spec, 3, jnp.float32, "forward").stream
    assert mosaic_gpu.plan(spec, 3, jnp.float32, "backward").stream
    got = _run(spec, x, scale, bias, dy, interpret=_race_checked())
    _check(spec, jnp.float32, x, scale, bias, dy, got)


@pytest.mark.parametrize(
    "n, k, inside, dtype",
    [(96, 7, False, jnp.float32), (4096, 300, True, jnp.bfloat16)],
)
def test_partial_rms_norm_with_offset_and_both_placements(n, k, inside, dtype):
    """pRMSNorm: k = 7 of n = 96 (row tiles), k = 300 of 4096 (a split row: the mask
    crosses a chunk), scale_offset = 1.0, no bias; "inside" row tiles are the sweep's."""
    spec = _spec(n, dtype, k=k, inside=inside, offset=1.0, bias=False)
    x, scale, _, dy = _inputs(21 if n < 4096 else 3, n, dtype, seed=2)
    _check(spec, dtype, x, scale, None, dy, _run(spec, x, scale, None, dy))


@pytest.mark.parametrize(
    "x_dtype, out_dtype", [(jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.float16)]
)
def test_no_scale_no_bias(x_dtype, out_dtype):
    """Without parameters the 16-bit forward holds 16-byte vectors of 8 features; float16
    y (and dy) of float32 rows."""
    spec = _spec(256, out_dtype, scale=False, bias=False)
    x, _, _, dy = _inputs(9, 256, x_dtype, seed=3)
    dy = dy.astype(out_dtype)
    widest = max(jnp.dtype(x_dtype).itemsize, jnp.dtype(out_dtype).itemsize)
    assert mosaic_gpu.plan(spec, 9, x_dtype, "forward").v == 16 // widest
    _check(spec, out_dtype, x, None, None, dy, _run(spec, x, None, None, dy))


def test_an_all_zero_row_with_eps_outside():
    """s = 0: y = bias, stat = 0, and dx = (scale + offset) * dy / eps (the cross term's
    limit is 0; autodiff of sqrt gives nan there, so these are hand-computed)."""
    spec = _spec(512, jnp.float32, inside=False, offset=1.0)
    x, scale, bias, dy = _inputs(6, 512, jnp.float32, seed=4)
    x = x.at[2].set(0.0)
    y, stat, dx, dscale, dbias = _run(spec, x, scale, bias, dy)
    f32 = tol(jnp.float32)
    assert float(stat[2]) == 0.0
    assert_close(y[2], bias, **f32)
    assert_close(dx[2], (np.asarray(scale) + 1.0) * np.asarray(dy[2]) / EPS, **f32)
    assert np.isfinite(np.asarray(dx)).all()
    others = np.array([0, 1, 3, 4, 5])
    with jax.enable_x64(True):
        y_o, _, (dx_o, dscale_o, dbias_o) = _oracle(spec, x[others], scale, bias, dy[others])
        assert_close(y[others], y_o, **f32)
        assert_close(dx[others], dx_o, **f32)
        # The zero row adds dy * 0 to the scale gradient and dy to the bias gradient.
        assert_close(dscale.sum(0), dscale_o, **f32)
        assert_close(dbias.sum(0), np.asarray(dbias_o) + np.asarray(dy[2], np.float64), **f32)


@pytest.mark.parametrize("x_dtype, res_dtype, h_dtype, n", [
    (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, 1000),  # no bias (test_fits)
    (jnp.bfloat16, jnp.float32, jnp.float32, 4096),
    (jnp.float16, jnp.float32, jnp.float16, 128),
])  # fmt: skip
def test_residual_form(x_dtype, res_dtype, h_dtype, n):
    """h = x + residual in h_dtype; y = norm(h); dx = dresidual = dnorm(h) + dh."""
    rows = 11 if n < 4096 else 3
    spec = _spec(n, x_dtype, offset=1.0, bias=n != 1000)
    x, scale, bias, dy = _inputs(rows, n, x_dtype, seed=5)
    residual, _, _, dh = _inputs(rows, n, res_dtype, seed=6)
    bias = bias if spec.has_bias else None
    y, stat, h = mosaic_gpu.forward(
        spec, x, scale, bias, residual, h_dtype=h_dtype, interpret=INTERPRET
    )
    dx, dscale, dbias = mosaic_gpu.backward(
        spec, h, dy, stat, scale, dh.astype(h_dtype), dx_dtype=h_dtype, interpret=INTERPRET
    )
    assert (h.dtype, dx.dtype) == (h_dtype, h_dtype)
    h_expected = x.astype(h_dtype) + residual.astype(h_dtype)
    np.testing.assert_array_equal(np.asarray(h, np.float64), np.asarray(h_expected, np.float64))
    with jax.enable_x64(True):
        kw = dict(eps=EPS, scale_offset=1.0)
        # The oracle normalizes the h the kernel wrote (rounded to h_dtype), so h's own
        # rounding is not counted twice.
        h64, dy64, dh64 = to64((h, dy, dh.astype(h_dtype)))
        s64, b64 = to64((scale, bias))

        def loss(h, scale, bias):
            return jnp.sum(rms_norm_reference(h, scale, bias=bias, **kw) * dy64)

        y_o = rms_norm_reference(h64, s64, bias=b64, **kw)
        dx_o, dscale_o, dbias_o = jax.grad(loss, argnums=(0, 1, 2))(h64, s64, b64)
        assert_close(y, y_o, **tol(x_dtype))
        assert_close(dx, dx_o + dh64, **tol(h_dtype))
        assert_close(dscale.sum(0), dscale_o, **tol(jnp.float32))
        if spec.has_bias:
            assert_close(dbias.sum(0), dbias_o, **tol(jnp.float32))


@pytest.mark.parametrize("n, rows, programs", [(2048, 13, 3), (4096, 5, 2)])
def test_persistent_backward_partials_hold_each_programs_rows(n, rows, programs):
    """Program p walks row blocks p, p + programs, ... (both staging slots, a partial
    last block of 4 rows at 2048 features) and writes the sums of its rows only; eps = 0
    with "outside": rows past the end would give nan without the masks. Free of data
    races (slots refilled while the other is read, rings, the statistic's ring)."""
    spec = _spec(n, jnp.float32, eps=0.0, inside=False)
    x, scale, bias, dy = _inputs(rows, n, jnp.float32, seed=7)
    plan = mosaic_gpu.plan(spec, rows, jnp.float32, "backward")
    races = _race_checked()
    forward_blocks = mosaic_gpu.plan(spec, rows, jnp.float32, "forward").blocks(rows)
    _, stat, _ = mosaic_gpu.forward(
        spec, x, scale, bias, interpret=races, programs=min(programs, forward_blocks)
    )
    dx, dscale, dbias = mosaic_gpu.backward(
        spec, x, dy, stat, scale, dx_dtype=jnp.float32, interpret=races, programs=programs
    )
    assert dscale.shape == dbias.shape == (programs * plan.acc_rows, n)
    with jax.enable_x64(True):
        x64, dy64 = to64((x, dy))
        xhat = np.asarray(rms_norm_reference(x64, eps=0.0, eps_placement="outside"))
        block_of = np.arange(rows) // plan.R
        f32 = tol(jnp.float32)
        for program in range(programs):
            mine = block_of % programs == program
            got = slice(program * plan.acc_rows, (program + 1) * plan.acc_rows)
            assert_close(dscale[got].sum(0), (np.asarray(dy64) * xhat)[mine].sum(0), **f32)
            assert_close(dbias[got].sum(0), np.asarray(dy64)[mine].sum(0), **f32)
        _, _, (dx_o, _, _) = _oracle(spec, x, scale, bias, dy)
        assert_close(dx, dx_o, **tol(jnp.float32))


def test_fits():
    """What the kernels take (one float32 sum of 32768 features: 128 KiB of shared
    memory; the rows of a TMA copy must be whole 16-byte multiples)."""
    bf16, f32 = jnp.bfloat16, jnp.float32
    fits = mosaic_gpu.fits
    for n in (64, 128, 256, 1000, 4096, 5120, 8192, 16384, 32768):
        assert fits(_spec(n, bf16, bias=False), 4096, bf16), n
    assert fits(_spec(65536, bf16, bias=False), 8, bf16, kind="forward")
    assert not fits(_spec(65536, bf16, bias=False), 8, bf16, kind="backward")
    assert not fits(_spec(32768, f32), 8, f32, kind="backward")  # two sums: 256 KiB
    assert not fits(_spec(1000, f32), 8, f32, kind="backward")  # 16-row tiles of sums
    assert not fits(_spec(100, bf16), 8, bf16)  # 200-byte rows
    assert not fits(_spec(131072, bf16), 8, bf16, kind="forward")
    assert not fits(_spec(1024, f32), 8, jnp.float64)
    assert not fits(_spec(1024, jnp.float64), 8, f32)
    assert not fits(_spec(1024, f32), 0, f32)


def test_bad_arguments_name_the_argument_and_the_fix():
    spec = _spec(64, jnp.float32)
    x, scale, bias, dy = _inputs(4, 64, jnp.float32)
    with pytest.raises(ValueError, match=r"x must have shape \(rows, 64\).*reshape"):
        mosaic_gpu.forward(spec, x.reshape(8, 32), scale, bias, interpret=True)
    with pytest.raises(ValueError, match=r"bias is None but spec\.has_bias"):
        mosaic_gpu.forward(spec, x, scale, None, interpret=True)
    with pytest.raises(TypeError, match=r"h_dtype must be float32.*implementation='xla'"):
        mosaic_gpu.forward(spec, x, scale, bias, x, interpret=True)
    with pytest.raises(ValueError, match=r"does not take 4 rows of 100 features.*fits\("):
        ones = jnp.ones((100,), jnp.bfloat16)
        mosaic_gpu.forward(_spec(100, jnp.bfloat16), ones * x[:, :1], ones, ones, interpret=True)
    stat = jnp.ones((4,))
    with pytest.raises(ValueError, match=r"stat must have shape \(4,\)"):
        mosaic_gpu.backward(spec, x, dy, stat[:2], scale, dx_dtype=jnp.float32, interpret=True)
    with pytest.raises(ValueError, match="programs must be between 1 and the 1 row blocks"):
        mosaic_gpu.backward(spec, x, dy, stat, scale, dx_dtype=jnp.float32, programs=2)


# ---------------------------------------------------------------- deviceless H100 compile


def _ptxas(folder) -> dict[str, tuple[int, int, int]]:
    """kernel -> (registers, spill store bytes, spill load bytes) from ptxas' reports."""
    found = {}
    for path in sorted(Path(folder).glob("*.ptxas")):
        text = path.read_text()
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
        registers = re.search(r"Used (\d+) registers", text)
        found[path.stem] = (
            int(registers.group(1)),
            int(spills.group(1)),
            int(spills.group(2)),
        )
    return found


def _smem(folder) -> dict[str, int]:
    """kernel -> shared-memory bytes Mosaic GPU allocated."""
    return {
        path.name.split(".")[0]: int(re.search(r"smem_scratch_bytes=(\d+)", path.read_text())[1])
        for path in sorted(Path(folder).glob("*.resources.txt"))
    }


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("n", [128, 4096, 8192, 16384, 32768])
def test_h100_compile_is_two_mosaic_gpu_kernels_without_spills(n, dtype, tmp_path, monkeypatch):
    target = aot_target("h100")
    mesh = target.mesh((1,), ("d",))
    rows = 2 * 1024 * 1024 // n  # 2M elements (the compile does not depend on it much)
    residual = n == 4096  # the add_rms_norm form once, with a float32 residual stream
    spec = _spec(n, dtype, offset=1.0, bias=False)

    def forward_backward(x, other, scale, dy):
        res = other if residual else None
        y, stat, h = mosaic_gpu.forward(spec, x, scale, None, res, h_dtype=jnp.float32)
        rows_ = h if residual else x
        dx, dscale, _ = mosaic_gpu.backward(spec, rows_, dy, stat, scale, res, dx_dtype=rows_.dtype)
        return y, h, dx, dscale.sum(0)

    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTXAS", "1")
    monkeypatch.setenv("MOSAIC_GPU_DUMP_TO", str(tmp_path))
    rows_struct = aot.struct((rows, n), dtype, mesh, P())
    other = aot.struct((rows, n), jnp.float32, mesh, P())
    vector = aot.struct((n,), jnp.float32, mesh, P())
    text = target.compile(
        jax.jit(forward_backward), rows_struct, other, vector, rows_struct
    ).as_text()
    calls = re.findall(r'custom_call_target="([^"]+)"', text)
    assert len(calls) == 2 and all(c.startswith("mosaic_gpu") for c in calls), calls
    assert "xla.gpu.triton" not in text  # no Pallas-Triton kernel
    ptxas = _ptxas(tmp_path)
    assert len(ptxas) == 2, sorted(os.listdir(tmp_path))
    for kernel, (registers, stores, loads) in ptxas.items():
        assert registers <= 255 and stores == loads == 0, (kernel, registers, stores, loads)
    res_dtype = jnp.float32 if residual else None
    fwd = mosaic_gpu.plan(spec, rows, dtype, "forward", residual_dtype=res_dtype,
                          h_dtype=res_dtype)  # fmt: skip
    x_dtype = jnp.float32 if residual else dtype
    bwd = mosaic_gpu.plan(spec, rows, x_dtype, "backward", residual_dtype=res_dtype,
                          dx_dtype=x_dtype)  # fmt: skip
    smem = _smem(tmp_path)
    assert sorted(smem.values()) == sorted([fwd.smem, bwd.smem]), (smem, fwd, bwd)
