"""The Pallas Mosaic TPU kernels (``rmsnorm_jax.kernels.mosaic_tpu``) and the TPU7x target.

- Their numerics against the float64 formula, in interpret mode: ``test_backends.py``.
- Deviceless compiles, one single-device program per TPU generation: the forward and
  backward kernels are the program's only full-size passes, at the widest rows that
  ``fits`` accepts too (so the block sizing stays within each generation's VMEM).
- The bytes model from the kernels' grids and BlockSpecs: 2 x-sizes forward, 5 forward
  and backward, plus small per-row and per-block terms.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import aot_target
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rmsnorm_jax.kernels import KernelSpec, mosaic_tpu, mosaic_tpu_plan

pytestmark = pytest.mark.newest

F32, BF16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16)
TPU_TARGETS = {"v4": "tpu-v4", "v5e": "tpu-v5e", "v5p": "tpu-v5p", "v6e": "tpu-v6e"}
TPU_TARGETS["tpu7x"] = "tpu7x"


def _spec(n, dtype, *, p=1.0, eps=1e-6, inside=True, offset=0.0, scale=True, bias=False):
    k = min(n, int(np.ceil(round(n * p, 9))))
    return KernelSpec(n, k, eps, inside, offset, scale, bias, np.dtype(dtype))


# ---------------------------------------------------------------- fits and block sizes


def test_fits_and_the_block_sizes():
    spec = _spec(4096, BF16)
    assert mosaic_tpu_plan.fits(spec, 8192, BF16)
    assert not mosaic_tpu_plan.fits(spec, 0, BF16)
    assert not mosaic_tpu_plan.fits(_spec(1 << 20, F32), 8192, F32)  # 4 MiB rows: stays on XLA
    for name in mosaic_tpu_plan.GENERATIONS:
        for kind in ("forward", "backward"):
            for dtype, tile in ((F32, 8), (BF16, 16)):
                p = mosaic_tpu_plan.plan(
                    _spec(4096, dtype), 8192, dtype, kind, generation_name=name
                )
                assert p.block_rows % tile == 0 and p.generation.name == name
                assert p.grid[-1] >= 2  # enough steps for the pipeline
    # Small VMEM (v4), smaller blocks; the unknown generation sizes for the smallest.
    v4 = mosaic_tpu_plan.plan(spec, 8192, BF16, "backward", generation_name="v4").block_rows
    v5e = mosaic_tpu_plan.plan(spec, 8192, BF16, "backward", generation_name="v5e").block_rows
    assert v4 < v5e
    assert mosaic_tpu_plan.plan(spec, 8192, BF16, "backward").block_rows == v4
    with pytest.raises(ValueError, match="unknown TPU generation 'v9'"):
        mosaic_tpu_plan.plan(spec, 8192, BF16, generation_name="v9")


# ---------------------------------------------------------------- bytes model


@pytest.mark.parametrize("generation_name", list(mosaic_tpu_plan.GENERATIONS))
@pytest.mark.parametrize("rows, n, dtype", [(8192, 4096, BF16), (1000, 1000, F32)])
def test_bytes_moved_are_two_x_sizes_forward_five_with_the_backward(
    generation_name, rows, n, dtype
):
    spec = _spec(n, dtype, bias=True)
    x_size = rows * n * dtype.itemsize
    fwd = mosaic_tpu_plan.plan(spec, rows, dtype, "forward", generation_name=generation_name)
    bwd = mosaic_tpu_plan.plan(spec, rows, dtype, "backward", generation_name=generation_name)
    # Every full-size operand is copied once; the scale and bias once in all.
    for p, names in ((fwd, ("x", "y")), (bwd, ("x", "dy", "dx"))):
        for name in names:
            assert p.operand(name).bytes == x_size
        assert p.operand("scale").bytes == 4 * n
    # The per-row statistic: 4 bytes a row (its last block padded to block_rows).
    for p in (fwd, bwd):
        blocks = -(-rows // p.block_rows)
        assert 4 * rows <= p.operand("stat").bytes == 4 * blocks * p.block_rows
    # The partial sums: (8 * slots, n) float32 each, whatever the number of rows.
    slots = bwd.grid[0]
    for name in ("dscale_partials", "dbias_partials"):
        assert bwd.operand(name).bytes == 8 * slots * n * 4 <= 64 * n
    small_fwd = 4 * rows + 4 * fwd.block_rows + 2 * 4 * n
    small_bwd = small_fwd + 2 * 64 * n
    assert 2 * x_size <= fwd.bytes_moved <= 2 * x_size + small_fwd
    total = fwd.bytes_moved + bwd.bytes_moved
    assert 5 * x_size <= total <= 5 * x_size + small_fwd + small_bwd


def test_bytes_model_counts_partial_and_repeated_blocks_once():
    # 5 blocks of 8 rows, the last one partial; the backward's second slot repeats its
    # last block (3 steps for 2 blocks): neither is copied twice.
    spec = _spec(128, F32)
    p = mosaic_tpu_plan.plan(spec, 37, F32, "backward", generation_name="v4")
    assert (p.block_rows, p.grid) == (8, (2, 3))
    assert p.operand("x").bytes == 37 * 128 * 4
    assert p.operand("dx").bytes == 37 * 128 * 4


# ---------------------------------------------------------------- deviceless compiles

_OPCODE = re.compile(r"\s*(?:ROOT )?%[\w.-]+ = (.*?) ([a-z][a-z0-9-]*)\(")


def _entry_ops(compiled):
    """(opcode, result type) of every instruction of the entry computation."""
    text = compiled.as_text()
    entry = text[text.index("\nENTRY") :]
    return [m.groups()[::-1] for m in map(_OPCODE.match, entry.splitlines()[1:]) if m]


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "f64": 8, "s64": 8}


def _largest_array_bytes(result_type):
    """Bytes of the largest array in an HLO result type (a tuple may hold several)."""
    arrays = re.findall(r"\b([a-z]+\d*)\[([\d,]+)\]", result_type)
    sizes = [math.prod(int(d) for d in dims.split(",")) * _BYTES.get(t, 4) for t, dims in arrays]
    return max(sizes, default=0)


def _vmem_prefetch(op, result_type):
    """An asynchronous copy from HBM into VMEM (S(1)) that keeps the layout."""
    if op == "copy-done":
        return "S(1)}" in result_type
    if op != "copy-start":
        return False
    layouts = re.findall(r"\{[^{}]*\}", result_type)
    return len(layouts) >= 2 and layouts[0] == layouts[1].replace("}", "S(1)}")


def _widest(generation_name, dtype):
    """The widest multiple of 128 features that ``fits`` accepts on a generation."""
    lo, hi = 128, 1 << 18
    mesh_free = {"generation_name": generation_name}
    while hi - lo > 128:
        mid = (lo + hi) // 256 * 128
        spec = _spec(mid, dtype)
        f32 = dict(residual_dtype=F32, h_dtype=F32, dx_dtype=F32)
        ok = all(
            mosaic_tpu_plan.plan(spec, 4096, dtype, k, **f32, **mesh_free) is not None
            for k in ("forward", "backward")
        )
        lo, hi = (mid, hi) if ok else (lo, mid)
    return lo


@pytest.mark.parametrize("generation_name", list(TPU_TARGETS))
def test_deviceless_compile_holds_only_the_kernels(generation_name):
    """One program per generation: the forward and backward at 8192 x 1000 bfloat16
    (an odd feature count) and, in the same program, both kernels at the widest rows
    that fit (float32, the residual forms with float32 h and dh). Layouts are pinned
    row-major: left to itself, a standalone program takes x column-major for n = 1000
    and XLA copies it around the kernels (see the module doc of ``kernels.tpu``)."""
    target = aot_target(TPU_TARGETS[generation_name])
    mesh = Mesh(np.array(target.devices[:1]), ("d",))
    rows, n = 8192, 1000
    wide_rows, wide = 8, _widest(generation_name, F32)
    spec = _spec(n, BF16, bias=True)
    wide_spec = _spec(wide, F32, scale=False)

    def program(x, dy, scale, bias, wx, wr, wdh):
        y, stat, _ = mosaic_tpu.forward(spec, x, scale, bias)
        dx, dscale, dbias = mosaic_tpu.backward(spec, x, dy, stat, scale, dx_dtype=BF16)
        wy, wstat, wh = mosaic_tpu.forward(wide_spec, wx, None, None, wr, h_dtype=F32)
        wdx, _, _ = mosaic_tpu.backward(wide_spec, wh, wx, wstat, None, wdh, dx_dtype=F32)
        return y, dx, dscale, dbias, wy, wdx

    rep = NamedSharding(mesh, P())
    row_major = Format(Layout((0, 1)), rep)
    args = [
        jax.ShapeDtypeStruct((rows, n), BF16),
        jax.ShapeDtypeStruct((rows, n), BF16),
        jax.ShapeDtypeStruct((n,), BF16),
        jax.ShapeDtypeStruct((n,), BF16),
        *(jax.ShapeDtypeStruct((wide_rows, wide), F32) for _ in range(3)),
    ]
    shardings = [row_major, row_major, rep, rep, rep, rep, rep]
    out_shardings = (row_major, row_major, rep, rep, rep, rep)
    with jax.set_mesh(mesh):
        plan = mosaic_tpu_plan.plan(spec, rows, BF16)
        assert plan.generation.name == generation_name  # read from the mesh
        jitted = jax.jit(program, in_shardings=shardings, out_shardings=out_shardings)
        compiled = target.compile(jitted, *args)

    text = compiled.as_text()
    assert text.count('custom_call_target="tpu_custom_call"') == 4
    # Besides the kernels, no array of x's bytes or more: no copy of x, dy, y or dx, no
    # XLA pass over them. One exception, which is not a pass over HBM: XLA:TPU may
    # prefetch a kernel operand into VMEM (memory space S(1)) with an asynchronous copy
    # that keeps its layout (v6e does so for x, read by both kernels here).
    bookkeeping = {"parameter", "bitcast", "get-tuple-element", "tuple", "constant"}
    others = [
        (op, t)
        for op, t in _entry_ops(compiled)
        if op not in bookkeeping and op != "custom-call" and not _vmem_prefetch(op, t)
    ]
    x_bytes = rows * n * BF16.itemsize
    assert not [o for o in others if _largest_array_bytes(o[1]) >= x_bytes], others


# ---------------------------------------------------------------- TPU7x as a target


def test_tpu7x_is_an_aot_target_that_compiles_rms_norm():
    from rmsnorm_jax import aot, rms_norm

    assert "tpu7x" in aot.target_names()
    target = aot_target("tpu7x")
    assert (target.name, target.platform, len(target.devices)) == ("tpu7x:2x2x1", "tpu", 8)
    assert target.devices[0].device_kind == "TPU7x"
    assert target.hbm_bytes_per_s == pytest.approx(7.37e12 / 2)  # per TensorCore device

    mesh = target.mesh((8,), ("data",))
    x = aot.struct((8 * 256, 2048), jnp.bfloat16, mesh, P("data"))
    scale = aot.struct((2048,), jnp.float32, mesh, P())
    grad = jax.jit(jax.grad(lambda x, s: jnp.sum(rms_norm(x, s)), argnums=(0, 1)))
    compiled = target.compile(grad, x, scale)
    assert aot.estimate(compiled, target) > 0
