"""What is the Pallas-Triton kernels' own (``rmsnorm_jax/kernels/triton.py``): a partial
last block of wide rows, the persistent backward's partial sums, ``fits``, the sizing, the
argument errors, and a deviceless H100 compile (forward and backward are two Triton
kernels, and nothing else touches a full-size array). Their numerics against the float64
formula are ``test_backends.py``'s, as every backend's.
"""

import re

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
from rmsnorm_jax.kernels import _device, triton_sizing
from rmsnorm_jax.reference import rms_norm_reference

# A jax without Pallas-Triton has no such kernels (tests/kernels/test_no_triton.py).
triton = pytest.importorskip("rmsnorm_jax.kernels.triton")

pytestmark = pytest.mark.newest

INTERPRET = jax.default_backend() != "gpu"
EPS = 1e-5


def _run(spec, x, scale, bias, dy, **kw):
    scale = scale if spec.has_scale else None
    bias = bias if spec.has_bias else None
    y, stat, h = triton.forward(spec, x, scale, bias, interpret=INTERPRET, **kw)
    assert h is None
    dx, dscale, dbias = triton.backward(
        spec, x, dy, stat, scale, dx_dtype=x.dtype, interpret=INTERPRET, **kw
    )
    return y, stat, dx, dscale, dbias


def test_a_partial_last_block_of_wide_rows():
    """n = 5120 with blocks of 2 rows over 5 rows: masked rows and padded columns."""
    spec = _spec(5120, jnp.bfloat16, offset=1.0)
    x, scale, bias, dy = kernel_inputs(5, 5120, jnp.bfloat16, seed=1)
    got = _run(spec, x, scale, bias, dy, block_rows=2)
    check_kernel_outputs(spec, jnp.bfloat16, x, scale, bias, dy, got)


def test_persistent_backward_partials_hold_each_programs_rows():
    """3 programs over 13 blocks of 1 row: program p sums rows p, p + 3, ...; its
    last step may lie past the end (eps = 0 with "outside": a stat of 1 read there
    would still give nan without the masks)."""
    rows, n = 13, 48
    spec = _spec(n, jnp.float32, eps=0.0, inside=False)
    x, scale, bias, dy = kernel_inputs(rows, n, jnp.float32, seed=7)
    _, stat, _ = triton.forward(spec, x, scale, bias, interpret=INTERPRET, block_rows=1)
    dx, dscale, dbias = triton.backward(
        spec, x, dy, stat, scale, dx_dtype=jnp.float32, interpret=INTERPRET,
        block_rows=1, programs=3,
    )  # fmt: skip
    assert dscale.shape == dbias.shape == (3, n)
    with jax.enable_x64(True):
        x64, dy64 = to64((x, dy))
        xhat = np.asarray(rms_norm_reference(x64, eps=0.0, eps_placement="outside"))
        for program in range(3):
            mine = np.arange(program, rows, 3)
            f32 = tol(jnp.float32)
            assert_close(dscale[program], (np.asarray(dy64) * xhat)[mine].sum(0), **f32)
            assert_close(dbias[program], np.asarray(dy64)[mine].sum(0), **f32)
        _, _, (dx_o, _, _) = kernel_oracle(spec, x, scale, bias, dy)
        assert_close(dx, dx_o, **tol(jnp.float32))


def test_fits():
    assert triton.fits(_spec(8192, jnp.bfloat16), 4096, jnp.bfloat16)
    assert triton.fits(_spec(5120, jnp.float32, k=320), 1, jnp.float16)
    assert not triton.fits(_spec(8193, jnp.bfloat16), 4096, jnp.bfloat16)  # too wide a row
    assert not triton.fits(_spec(16384, jnp.float32), 4096, jnp.float32)
    assert not triton.fits(_spec(1024, jnp.float32), 8, jnp.float64)
    assert not triton.fits(_spec(1024, jnp.float64), 8, jnp.float32)
    assert not triton.fits(_spec(1024, jnp.float32), 0, jnp.float32)


def test_block_sizes():
    """The sizing measured on an H200 (``kernels/data/triton_sizing.json``), by hand:
    (n, rows) -> (padded features, rows per block, forward warps, backward warps,
    backward programs on 132 SMs)."""
    for (n, rows), expected in {
        (4096, 8192): (4096, 1, 8, 8, 264),
        (4096, 2048): (4096, 1, 8, 8, 264),  # 7.75 rows a program: two programs an SM
        (5120, 8192): (8192, 1, 8, 4, 264),  # 4 warps, two programs an SM
        (6144, 8192): (8192, 1, 8, 4, 264),
        (8192, 8192): (8192, 1, 8, 8, 132),  # one program an SM
        (1000, 8192): (1024, 4, 8, 8, 264),
        (4096, 1024): (4096, 1, 8, 8, 132),  # fewer than 4 rows a program: one per SM
        (4096, 100): (4096, 1, 8, 8, 100),
        (4096, 600): (4096, 1, 8, 8, 132),  # 150 would be a partial second wave: 132
        (128, 100): (128, 32, 8, 8, 4),
        (100, 3): (128, 4, 1, 1, 1),
    }.items():
        block = triton_sizing.default_block_rows(n, rows)
        got = (triton_sizing.padded_features(n), block, triton_sizing.num_warps(n, block))
        got += (
            triton_sizing.backward_warps(n, block),
            triton_sizing.backward_programs(n, rows, block, sms=132),
        )
        assert got == expected, (n, rows, got)


def test_its_own_bad_arguments_name_the_argument_and_the_fix():
    """What this backend alone checks (the shared checks: test_backends.py)."""
    spec = _spec(64, jnp.float32)
    x, scale, bias, dy = kernel_inputs(4, 64, jnp.float32)
    with pytest.raises(
        ValueError, match=r"block_rows must be a positive power of two.*got 3; pass e\.g\. 4"
    ):
        triton.forward(spec, x, scale, bias, interpret=True, block_rows=3)
    stat = jnp.ones((4,))
    with pytest.raises(ValueError, match="programs must be between 1 and the 1 row blocks"):
        triton.backward(spec, x, dy, stat, scale, dx_dtype=jnp.float32, programs=2)


# ---------------------------------------------------------------- deviceless H100 compile

_ENTRY_OP = re.compile(r"^\s*(?:ROOT\s+)?%[\w.-]+\s*=\s*(.+?)\s+([\w-]+)\((.*)$")
_PASS_THROUGH = {"parameter", "tuple", "get-tuple-element", "bitcast"}


def _full_size_ops(text: str, rows: int, n: int) -> list[tuple[str, str]]:
    """(opcode, line) of every instruction of the entry computation that reads or writes
    a (rows, n) array, other than parameters, tuples and bitcasts."""
    entry = text[text.index("\nENTRY") :]
    full = f"[{rows},{n}]"
    found = []
    for line in entry.splitlines()[1:]:
        match = _ENTRY_OP.match(line)
        if match and full in line and match.group(2) not in _PASS_THROUGH:
            found.append((match.group(2), line.strip()))
    return found


@pytest.mark.parametrize(
    "rows, n, dtype, residual, k, inside",
    [(8192, 4096, jnp.bfloat16, False, 4096, True), (4096, 5120, jnp.float16, True, 320, False)],
)
def test_h100_forward_and_backward_are_two_triton_kernels(rows, n, dtype, residual, k, inside):
    target = aot_target("h100")
    mesh = target.mesh((1,), ("d",))
    spec = _spec(n, dtype, k=k, inside=inside)

    def forward_backward(x, other, scale, bias, dy):
        y, stat, h = triton.forward(
            spec, x, scale, bias, other if residual else None, h_dtype=dtype
        )
        normalized = h if residual else x
        dh = other if residual else None
        dx, dscale, dbias = triton.backward(spec, normalized, dy, stat, scale, dh, dx_dtype=dtype)
        return y, h, dx, dscale.sum(0), dbias.sum(0)

    rows_struct = aot.struct((rows, n), dtype, mesh, P())
    vector = aot.struct((n,), jnp.float32, mesh, P())
    compiled = target.compile(
        jax.jit(forward_backward), rows_struct, rows_struct, vector, vector, rows_struct
    )
    text = compiled.as_text()
    ops = _full_size_ops(text, rows, n)
    assert ops, "the program reads and writes (rows, n) arrays"
    assert all(op == "custom-call" and "__gpu$xla.gpu.triton" in line for op, line in ops), ops
    assert len(ops) == 2  # one forward kernel, one backward kernel
    programs = triton_sizing.backward_programs(n, rows, triton_sizing.default_block_rows(n, rows))
    assert f"f32[{programs},{n}]" in ops[1][1]  # the partial sums


@pytest.mark.parametrize("name, sms", [("h100", 132), ("a100", 108)])
def test_backward_sized_for_the_gpu_being_compiled_for(name, sms):
    """The persistent grid follows the target's SM count (its abstract mesh), and above
    one program per SM is a whole number of waves."""
    from helpers import aot_target

    target = aot_target(name)
    mesh = jax.sharding.Mesh(target.devices[:1], ("d",))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        assert _device.target().sms == sms
        for n, rows in [(4096, 8192), (4096, 2000), (5120, 8192), (1000, 8192), (4096, 100)]:
            block = triton_sizing.default_block_rows(n, rows)
            programs = triton_sizing.backward_programs(n, rows, block)
            assert programs <= sms or programs % sms == 0, (n, rows, programs)
            assert programs <= -(-rows // block)
