"""Every kernel backend against the float64 formula: one suite, run once per backend.

The backends implement one contract (``rmsnorm_jax/kernels/_contract.py``):
``forward(spec, x, scale, bias, residual=None, *, h_dtype, interpret) -> (y, stat, h)``
and ``backward(spec, x, dy, stat, scale, dh=None, *, dx_dtype, interpret) -> (dx,
dscale_partials, dbias_partials)``. Each runs compiled on its own device (Triton and Mosaic
GPU on an NVIDIA GPU, Mosaic TPU on a TPU) and in interpret mode elsewhere. The oracle is
the plain formula in float64 under ``jax.vjp`` on the same input values
(``helpers.kernel_oracle``). What belongs to one backend (its sizing, its persistent
partial sums, its compiled program) is in ``test_triton.py``, ``test_mosaic_tpu.py`` and
``test_mosaic_gpu.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, check_kernel_outputs, kernel_inputs, kernel_oracle, to64, tol
from helpers import kernel_spec as _spec

from rmsnorm_jax.kernels import BACKENDS, _device, _select
from rmsnorm_jax.reference import rms_norm_reference

pytestmark = pytest.mark.newest
EPS = 1e-5


def _usable(name: str):
    """``(module, None)`` of the backend ``name``, or ``(None, why it cannot run here)``."""
    module, why = _select.load(name)
    if module is None:
        return None, why
    return module, module.unusable(_device.target())


@pytest.fixture(params=list(BACKENDS))
def backend(request):
    """``(module, interpret)`` of one backend: compiled on its own platform, interpreted
    elsewhere."""
    module, reason = _usable(request.param)
    if reason is not None:
        pytest.skip(reason)
    return module, _device.target().platform != module.PLATFORM


def _taken(module, spec, rows, dtype, **dtypes):
    """Skips where ``module.fits`` refuses the call (its own tests say where)."""
    for kind in ("forward", "backward"):
        if not module.fits(spec, rows, dtype, kind=kind, **dtypes):
            pytest.skip(f"{module.__name__} does not take {rows} x {spec.n} {kind}")


def _run(backend, spec, x, scale, bias, dy):
    module, interpret = backend
    _taken(module, spec, x.shape[0], x.dtype)
    scale = scale if spec.has_scale else None
    bias = bias if spec.has_bias else None
    y, stat, h = module.forward(spec, x, scale, bias, interpret=interpret)
    assert h is None
    dx, dscale, dbias = module.backward(
        spec, x, dy, stat, scale, dx_dtype=x.dtype, interpret=interpret
    )
    return y, stat, dx, dscale, dbias


# QK-norm's 64 features (many rows a block), an odd width (1000) and a wide one (4096);
# rows that leave the last block partial. 1000 without bias: the Mosaic GPU backward's
# float32 sums of both parameters at 1000 features do not fit (test_mosaic_gpu.test_fits).
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("rows, n", [(37, 64), (13, 1000), (3, 4096)])
def test_forward_and_backward_match_the_float64_formula(backend, dtype, rows, n):
    spec = _spec(n, dtype, bias=n != 1000)
    x, scale, bias, dy = kernel_inputs(rows, n, dtype)
    check_kernel_outputs(spec, dtype, x, scale, bias, dy, _run(backend, spec, x, scale, bias, dy))


@pytest.mark.parametrize(
    "n, k, inside, dtype", [(96, 7, False, jnp.float32), (4096, 300, True, jnp.bfloat16)]
)
def test_partial_rms_norm_with_offset_and_both_placements(backend, n, k, inside, dtype):
    """pRMSNorm: the first k features in the statistic (7 of 96; 300 of 4096, a mask that
    ends inside a chunk of the row), ``scale_offset=1``, no bias."""
    spec = _spec(n, dtype, k=k, inside=inside, offset=1.0, bias=False)
    x, scale, _, dy = kernel_inputs(21 if n < 4096 else 3, n, dtype, seed=2)
    check_kernel_outputs(spec, dtype, x, scale, None, dy, _run(backend, spec, x, scale, None, dy))


@pytest.mark.parametrize(
    "x_dtype, out_dtype", [(jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.float16)]
)
def test_no_scale_no_bias_and_another_output_dtype(backend, x_dtype, out_dtype):
    spec = _spec(256, out_dtype, scale=False, bias=False)
    x, _, _, dy = kernel_inputs(9, 256, x_dtype, seed=3)
    dy = dy.astype(out_dtype)
    got = _run(backend, spec, x, None, None, dy)
    check_kernel_outputs(spec, out_dtype, x, None, None, dy, got)


def test_an_all_zero_row_with_eps_outside(backend):
    """s = 0: y = bias, stat = 0, and dx = (scale + offset) * dy / eps (the cross term's
    limit is 0; autodiff of sqrt gives nan there, so these are hand-computed)."""
    spec = _spec(512, jnp.float32, inside=False, offset=1.0)
    x, scale, bias, dy = kernel_inputs(6, 512, jnp.float32, seed=4)
    x = x.at[2].set(0.0)
    y, stat, dx, dscale, dbias = _run(backend, spec, x, scale, bias, dy)
    f32 = tol(jnp.float32)
    assert float(stat[2]) == 0.0
    assert_close(y[2], bias, **f32)
    assert_close(dx[2], (np.asarray(scale) + 1.0) * np.asarray(dy[2]) / EPS, **f32)
    assert np.isfinite(np.asarray(dx)).all()
    others = np.array([0, 1, 3, 4, 5])
    with jax.enable_x64(True):
        y_o, _, (dx_o, dscale_o, dbias_o) = kernel_oracle(spec, x[others], scale, bias, dy[others])
        assert_close(y[others], y_o, **f32)
        assert_close(dx[others], dx_o, **f32)
        # The zero row adds dy * 0 to the scale gradient and dy to the bias gradient.
        assert_close(dscale.sum(0), dscale_o, **f32)
        assert_close(dbias.sum(0), np.asarray(dbias_o) + np.asarray(dy[2], np.float64), **f32)


@pytest.mark.parametrize("x_dtype, res_dtype, h_dtype, n", [
    (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, 1000),
    (jnp.bfloat16, jnp.float32, jnp.float32, 4096),
    (jnp.float16, jnp.float32, jnp.float16, 128),
])  # fmt: skip
def test_residual_form(backend, x_dtype, res_dtype, h_dtype, n):
    """h = x + residual in h_dtype, written and normalized; dx = dresidual = dnorm(h) + dh."""
    module, interpret = backend
    rows = 11 if n < 4096 else 3
    spec = _spec(n, x_dtype, offset=1.0, bias=n != 1000)
    dtypes = dict(residual_dtype=res_dtype, h_dtype=h_dtype, dx_dtype=h_dtype)
    _taken(module, spec, rows, x_dtype, **dtypes)
    x, scale, bias, dy = kernel_inputs(rows, n, x_dtype, seed=5)
    residual, _, _, dh = kernel_inputs(rows, n, res_dtype, seed=6)
    bias = bias if spec.has_bias else None
    y, stat, h = module.forward(
        spec, x, scale, bias, residual, h_dtype=h_dtype, interpret=interpret
    )
    dh = dh.astype(h_dtype)
    dx, dscale, dbias = module.backward(
        spec, h, dy, stat, scale, dh, dx_dtype=h_dtype, interpret=interpret
    )
    assert (h.dtype, dx.dtype) == (h_dtype, h_dtype)
    h_expected = x.astype(h_dtype) + residual.astype(h_dtype)
    np.testing.assert_array_equal(np.asarray(h, np.float64), np.asarray(h_expected, np.float64))
    with jax.enable_x64(True):
        kw = dict(eps=EPS, scale_offset=1.0)
        # The oracle normalizes the h the kernel wrote (rounded to h_dtype), so h's own
        # rounding is not counted twice.
        h64, dy64, dh64, s64, b64 = to64((h, dy, dh, scale, bias))

        def loss(h, scale, bias):
            return jnp.sum(rms_norm_reference(h, scale, bias=bias, **kw) * dy64)

        dx_o, dscale_o, dbias_o = jax.grad(loss, argnums=(0, 1, 2))(h64, s64, b64)
        assert_close(y, rms_norm_reference(h64, s64, bias=b64, **kw), **tol(x_dtype))
        assert_close(dx, dx_o + dh64, **tol(h_dtype))
        assert_close(dscale.sum(0), dscale_o, **tol(jnp.float32))
        if spec.has_bias:
            assert_close(dbias.sum(0), dbias_o, **tol(jnp.float32))


def test_bad_arguments_name_the_argument_and_the_fix(backend):
    """The contract's checks (``_contract.check_forward``/``check_backward``), the same in
    every backend: each names the argument, what it got and the fix, before any kernel."""
    module, interpret = backend
    spec = _spec(64, jnp.float32)
    x, scale, bias, dy = kernel_inputs(4, 64, jnp.float32)
    with pytest.raises(ValueError, match=r"x must have shape \(rows, 64\).*reshape"):
        module.forward(spec, x.reshape(8, 32), scale, bias, interpret=interpret)
    with pytest.raises(ValueError, match=r"bias is None but spec\.has_bias"):
        module.forward(spec, x, scale, None, interpret=interpret)
    with pytest.raises(ValueError, match=r"residual must have shape \(4, 64\)"):
        module.forward(spec, x, scale, bias, x[:2], h_dtype=jnp.float32, interpret=interpret)
    with pytest.raises(TypeError, match=r"h_dtype must be float32.*implementation='xla'"):
        module.forward(spec, x, scale, bias, x, interpret=interpret)
    with pytest.raises(TypeError, match=r"x must be float32, bfloat16 or float16.*'xla'"):
        module.forward(spec, x.astype(jnp.int32), scale, bias, interpret=interpret)
    stat = jnp.ones((4,))
    with pytest.raises(ValueError, match=r"stat must have shape \(4,\)"):
        module.backward(spec, x, dy, stat[:2], scale, dx_dtype=jnp.float32, interpret=interpret)
    with pytest.raises(ValueError, match=r"dy must have shape \(4, 64\)"):
        module.backward(spec, x, dy[:3], stat, scale, dx_dtype=jnp.float32, interpret=interpret)
    with pytest.raises(TypeError, match=r"dx_dtype must be float32"):
        module.backward(spec, x, dy, stat, scale, dx_dtype=jnp.int8, interpret=interpret)
