"""What is the Mosaic GPU kernels' own (``rmsnorm_jax/kernels/mosaic_gpu.py``): wide rows
staged and streamed, the persistent backward's partial sums, other sizings (all under the
interpreter's race detector), ``fits``, the argument errors, and a deviceless H100 compile
(each kernel one Mosaic GPU call, no register spills, the planned shared memory what Mosaic
allocates). On a CPU the kernels run in Mosaic GPU interpret mode (the same kernel bodies,
shared memory, TMA copies and barriers); on a GPU they run compiled. Their numerics against
the float64 formula over widths, dtypes and options are ``test_backends.py``'s.
"""

import dataclasses
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    aot_target,
    assert_close,
    check_kernel_outputs,
    kernel_inputs,
    kernel_oracle,
    to64,
    tol,
)
from helpers import kernel_spec as _spec
from jax.sharding import PartitionSpec as P

from rmsnorm_jax import aot
from rmsnorm_jax.kernels import mosaic_gpu, mosaic_gpu_sizing
from rmsnorm_jax.reference import rms_norm_reference

pytestmark = [
    pytest.mark.newest,
    pytest.mark.skipif(
        not mosaic_gpu.available(),
        reason=f"the Mosaic GPU kernels need jax >= 0.11.2 (plgpu.kernel and its interpret "
        f"mode, InterpretGPUParams); this is jax {jax.__version__}",
    ),
]
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


def _run(spec, x, scale, bias, dy, interpret=INTERPRET, sizing=mosaic_gpu_sizing.SIZING):
    scale = scale if spec.has_scale else None
    bias = bias if spec.has_bias else None
    y, stat, h = mosaic_gpu.forward(spec, x, scale, bias, interpret=interpret, sizing=sizing)
    assert h is None
    dx, dscale, dbias = mosaic_gpu.backward(
        spec, x, dy, stat, scale, dx_dtype=x.dtype, interpret=interpret, sizing=sizing
    )
    return y, stat, dx, dscale, dbias


def test_wide_rows_staged_forward_and_streamed_backward():
    """16384 features float32: the forward stages the row (two chunks per pass), the
    backward's two sums leave no room for the row: streamed. Free of data races."""
    spec = _spec(16384, jnp.float32, offset=1.0)
    x, scale, bias, dy = kernel_inputs(3, 16384, jnp.float32, seed=8)
    assert not mosaic_gpu_sizing.plan(spec, 3, jnp.float32, "forward").stream
    assert mosaic_gpu_sizing.plan(spec, 3, jnp.float32, "backward").stream
    got = _run(spec, x, scale, bias, dy, interpret=_race_checked())
    check_kernel_outputs(spec, jnp.float32, x, scale, bias, dy, got)


@pytest.mark.parametrize("n, rows, programs", [(2048, 13, 3), (4096, 5, 2)])
def test_persistent_backward_partials_hold_each_programs_rows(n, rows, programs):
    """Program p walks row blocks p, p + programs, ... (both staging slots, a partial
    last block of 4 rows at 2048 features) and writes the sums of its rows only; eps = 0
    with "outside": rows past the end would give nan without the masks. Free of data
    races (slots refilled while the other is read, rings, the statistic's ring)."""
    spec = _spec(n, jnp.float32, eps=0.0, inside=False)
    x, scale, bias, dy = kernel_inputs(rows, n, jnp.float32, seed=7)
    plan = mosaic_gpu_sizing.plan(spec, rows, jnp.float32, "backward")
    races = _race_checked()
    forward_blocks = mosaic_gpu_sizing.plan(spec, rows, jnp.float32, "forward").blocks(rows)
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
        _, _, (dx_o, _, _) = kernel_oracle(spec, x, scale, bias, dy)
        assert_close(dx, dx_o, **tol(jnp.float32))


ROWS = 77  # the last block partial under each sizing below
# features, dtype, the changes to the data's sizing, split rows (else row tiles)
SIZINGS = {
    "2048 split, wider chunks": (
        2048,
        jnp.bfloat16,
        dict(max_tile_features=1024, forward_chunk=32),
        True,
    ),
    "4096 tiles, the backward's one staging slot": (
        4096,
        jnp.bfloat16,
        dict(max_tile_features=4096),
        False,
    ),
    "256 larger blocks, wider chunks": (
        256,
        jnp.bfloat16,
        dict(block_elements=16384, backward_chunk=16),
        False,
    ),
}


@pytest.mark.parametrize("case", SIZINGS)
def test_other_sizings_give_the_formula(case):
    """The sizings ``python -m benchmarks.kernel_sizes --backend mosaic_gpu`` times, away
    from the data's: other plans (checked to differ, and the backward's partial sums to
    have the other plan's rows), the same values as the float64 formula; 77 rows, so the
    last block is partial. Free of data races."""
    n, dtype, changes, split = SIZINGS[case]
    spec = _spec(n, dtype, offset=1.0)
    sizing = dataclasses.replace(mosaic_gpu_sizing.SIZING, **changes)
    for kind in ("forward", "backward"):
        dtypes = dict(dx_dtype=dtype) if kind == "backward" else {}
        mine = mosaic_gpu_sizing.plan(spec, ROWS, dtype, kind, sizing=sizing, **dtypes)
        data = mosaic_gpu_sizing.plan(spec, ROWS, dtype, kind, **dtypes)
        assert mine.split == split, (kind, mine)
        assert (mine.T, mine.R, mine.split) != (data.T, data.R, data.split), (kind, mine)
    x, scale, bias, dy = kernel_inputs(ROWS, n, dtype, seed=9)
    got = _run(spec, x, scale, bias, dy, interpret=_race_checked(), sizing=sizing)
    check_kernel_outputs(spec, dtype, x, scale, bias, dy, got)
    # The backward ran the sizing's plan: its partial sums are a row per program and per
    # row of a chunk (row tiles) or one (split rows).
    sums = [mosaic_gpu_sizing.grid_size(p, ROWS) * p.acc_rows for p in (mine, data)]
    assert got[3].shape[0] == sums[0] != sums[1], sums


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


def test_its_own_bad_arguments_name_the_argument_and_the_fix():
    """What this backend alone checks (the shared checks: test_backends.py)."""
    spec = _spec(64, jnp.float32)
    x, scale, _, dy = kernel_inputs(4, 64, jnp.float32)
    with pytest.raises(ValueError, match=r"does not take 4 rows of 100 features.*fits\("):
        ones = jnp.ones((100,), jnp.bfloat16)
        mosaic_gpu.forward(_spec(100, jnp.bfloat16), ones * x[:, :1], ones, ones, interpret=True)
    stat = jnp.ones((4,))
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
    fwd = mosaic_gpu_sizing.plan(spec, rows, dtype, "forward", residual_dtype=res_dtype,
                          h_dtype=res_dtype)  # fmt: skip
    x_dtype = jnp.float32 if residual else dtype
    bwd = mosaic_gpu_sizing.plan(spec, rows, x_dtype, "backward", residual_dtype=res_dtype,
                          dx_dtype=x_dtype)  # fmt: skip
    smem = _smem(tmp_path)
    assert sorted(smem.values()) == sorted([fwd.smem, bwd.smem]), (smem, fwd, bwd)
