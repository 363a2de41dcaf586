"""The Gemma-3-style model of the benchmarks (``benchmarks/models.py``), small (issue 20).

Numerics of its norm variants (``benchmarks/peers.py``) against a float64 oracle, the train
step in both modes (unrolled and scanned blocks give the same loss), and deterministic facts
of deviceless compiles of a small config, made by ``python -m benchmarks gemma --target``.
The full size: ``python -m benchmarks gemma --target h100`` (or on a device, without
``--target``).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, deviceless_skip_reason, tol

import benchmarks.__main__ as cli
from benchmarks import estimates, models, peers

EPS = 1e-6


def gemma_formula64(x, scale):
    x, scale = jnp.asarray(x, jnp.float64), jnp.asarray(scale, jnp.float64)
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + EPS) * (1 + scale)


@pytest.mark.parametrize("name", list(peers.GEMMA_NORMS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_every_norm_is_one_plus_scale(name, dtype):
    """Each variant computes x / RMS(x) * (1 + scale) (value and gradients)."""
    norm = peers.GEMMA_NORMS[name]
    kx, ks, kc = jax.random.split(jax.random.key(0), 3)
    x = (2 * jax.random.normal(kx, (3, 4, 32), jnp.float32) + 0.3).astype(dtype)
    scale = 0.5 * jax.random.normal(ks, (32,), jnp.float32)
    ct = jax.random.normal(kc, x.shape, jnp.float32)

    def loss(x, s):
        return jnp.sum(norm(x, s).astype(jnp.float32) * ct)

    y = norm(x, scale)
    dx, ds = jax.grad(loss, argnums=(0, 1))(x, scale)
    assert y.dtype == dtype
    with jax.enable_x64(True):
        x64, s64, ct64 = (jnp.asarray(a, jnp.float64) for a in (x, scale, ct))
        dx64, ds64 = jax.grad(lambda x, s: jnp.sum(gemma_formula64(x, s) * ct64), argnums=(0, 1))(
            x64, s64
        )
        # bfloat16: Gemma's own formula rounds the normalised x before the scale.
        assert_close(y, gemma_formula64(x64, s64), **tol(dtype))
        assert_close(dx, dx64, **tol(dtype))
        assert_close(ds, ds64, **tol(dtype))


F32 = models.Config(
    vocab=128, d=32, layers=2, heads=2, kv_heads=1, head_dim=16, hidden=64, window=4,
    global_every=2, dtype=jnp.float32,
)  # fmt: skip


def _batch(cfg, batch=2, seq=8):
    tokens = jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, cfg.vocab)
    return tokens[:, :-1], tokens[:, 1:]


def test_model_logits_rms_norm_equal_gemma_formula_float32():
    """In float32 the swap changes no logit beyond rounding, on trained-like scales."""
    params = models.init_params(F32, jax.random.key(0), scan=False, norm_scale_std=0.5)
    tokens, _ = _batch(F32)

    @jax.jit
    def logits(params, tokens):
        # The last: a zero-centred scale read as x_hat * s (the trap), to show the
        # scales matter in this comparison.
        ours, gemma = peers.gemma_ours, peers.gemma_formula
        norms = (ours, gemma, lambda x, s: ours(x, s - 1.0))
        return [models.logits_fn(F32, n, params, tokens, scan=False) for n in norms]

    ours, theirs, wrong = logits(params, tokens)
    assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert float(jnp.max(jnp.abs(wrong - theirs))) > 0.1


def test_train_step_unrolled_and_scanned_agree():
    """One AdamW step of each mode, from the same parameters: same loss, same update."""
    cfg = models.SMALL
    unrolled = models.init_params(cfg, jax.random.key(0), scan=False, norm_scale_std=0.3)
    stacked = dict(unrolled, blocks=jax.tree.map(lambda *a: jnp.stack(a), *unrolled["blocks"]))
    tokens, targets = _batch(cfg, seq=16)
    results = {}
    for scan, params in ((False, unrolled), (True, stacked)):
        step = jax.jit(models.gemma_train_step(cfg, peers.gemma_ours, scan))
        new, _, loss = step(params, models.optimizer().init(params), tokens, targets)
        results[scan] = (float(loss), new)
    assert np.isfinite(results[False][0])
    assert results[False][0] == pytest.approx(results[True][0], rel=1e-3)
    new_unrolled, new_stacked = results[False][1], results[True][1]
    restacked = jax.tree.map(lambda *a: jnp.stack(a), *new_unrolled["blocks"])
    pairs = zip(jax.tree.leaves(restacked), jax.tree.leaves(new_stacked["blocks"]), strict=True)
    for a, b in pairs:
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-2, atol=1e-3)
    assert not np.allclose(new_unrolled["final_norm"], unrolled["final_norm"])


# ---------------------------------------------------------------- deviceless compiles


@pytest.fixture(scope="module")
def h100_scanned(tmp_path_factory):
    """The small config's train step under scan, compiled for H100 by the command line
    (``gemma --quick --target h100``, batch 2 x 64): one record per norm."""
    reason = deviceless_skip_reason("h100")
    if reason:
        pytest.skip(reason)
    names = ("rms_norm", "gemma's own", "flax nnx RMSNorm", peers.GEMMA_FLOOR)
    out = tmp_path_factory.mktemp("gemma")
    argv = ["gemma", "--quick", "--target", "h100", "--modes", "scan", "--norms", ",".join(names)]
    saved = cli.main([*argv, "--out", str(out)])
    assert (out / "gemma-h100-quick.md").read_text().startswith("**smoke run: not a measurement**")
    return {r["norm"]: r for r in saved["records"]}


def test_scanned_temp_memory_at_most_the_best_peers(h100_scanned):
    """Under scan the backward's float32 copies of the peers survive compilation; ours
    keeps one float per row (a compile fact of this jax/XLA, small config)."""
    ours = h100_scanned["rms_norm"]["temp_bytes"]
    others = (r for n, r in h100_scanned.items() if n not in ("rms_norm", peers.GEMMA_FLOOR))
    assert ours <= min(r["temp_bytes"] for r in others)


def test_scanned_temp_memory_is_the_floor_and_one_float_per_row():
    """Against ``x * (1 + scale)``, which keeps what any norm with a learnable scale
    must keep for its backward, ours keeps at most one float32 per row of each norm more:
    under scan no norm can save more memory in this model than ours does.

    Compiled with XLA:GPU's latency-hiding scheduler off, so that the two programs are
    ordered alike: on jax 0.12 the scan's updates become asynchronous and the scheduler
    (whose memory limit is the whole 80 GB card) overlaps four weight-gradient matmuls
    of ours and not of the floor, 108 KB of live range and 66 KB of heap packing that
    are no residual of either (with the scheduler on, ours - floor = 174,344 bytes; the
    scan's carried residuals differ by 8,064 bytes on jax 0.10 and 0.12 alike)."""
    reason = deviceless_skip_reason("h100")
    if reason:
        pytest.skip(reason)
    from rmsnorm_jax import aot

    target = dataclasses.replace(
        aot.get_target("h100"),
        extra_options=(("xla_gpu_enable_latency_hiding_scheduler", False),),
    )
    cfg, batch, seq = models.SMALL, 2, 64
    ours, floor = (
        estimates.gemma_step(target, cfg, name, "scan", batch, seq)[0]["temp_bytes"]
        for name in ("rms_norm", peers.GEMMA_FLOOR)
    )
    tokens = batch * seq
    rows_per_block = tokens * (4 + cfg.heads + cfg.kv_heads)  # 4 norms of d, QK-norms
    stat_bytes = 4 * (cfg.layers * rows_per_block + tokens)  # and the final norm
    assert ours - floor <= stat_bytes, (ours, floor)


def test_scanned_block_has_no_more_kernels_than_gemmas(h100_scanned):
    """Under scan a block's kernels are counted once: no extra ``scale + 1`` or per-row
    kernels beyond Gemma's own norm's program."""
    assert h100_scanned["rms_norm"]["kernels"] <= h100_scanned["gemma's own"]["kernels"]


def test_matmul_kernels_are_told_apart():
    """The non-matmul part excludes exactly the kernels that hold a dot."""
    text = (
        "%fused_dot (p: f32[2,2]) -> f32[2,2] {\n  %d = f32[2,2] dot(%p, %p)\n}\n"
        "%fused_add (p: f32[2,2]) -> f32[2,2] {\n  %a = f32[2,2] add(%p, %p)\n}\n"
    )
    bodies = estimates._computations(text)
    assert set(bodies) == {"fused_dot", "fused_add"}
    assert estimates._is_matmul("%f = f32[2,2] fusion(%x), calls=%fused_dot", bodies)
    assert not estimates._is_matmul("%g = f32[2,2] fusion(%x), calls=%fused_add", bodies)
