"""The MaxText-shaped model of the benchmarks (``benchmarks/models.py``), small (issue 28).

Its MaxText norm (``peers.maxtext_formula``) against the stand-in of MaxText's ``RMSNorm``;
the model with MaxText's norm and with ours in float32; scanned and unrolled layers; each
remat policy against none; and the ``maxtext --quick`` command line. The tables:
``python -m benchmarks maxtext --target h100`` (and ``--target tpu-v5e``).
"""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import maxtext_standin
import numpy as np
import pytest
from flax import nnx
from helpers import assert_close, deviceless_skip_reason

import benchmarks.__main__ as cli
from benchmarks import models, peers

TINY = models.MaxTextConfig(vocab=64, d=32, layers=2, heads=2, head_dim=16, hidden=64)
F32 = dataclasses.replace(TINY, dtype=jnp.float32)


def _tokens(cfg, batch=2, seq=8):
    tokens = jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, cfg.vocab)
    return tokens[:, :-1], tokens[:, 1:]


def _stacked(params):
    return dict(params, layers=jax.tree.map(lambda *a: jnp.stack(a), *params["layers"]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_maxtext_formula_is_the_standins_norm(dtype):
    """``peers.maxtext_formula`` is MaxText's ``RMSNorm`` bit for bit (its two roundings)."""
    kx, ks = jax.random.split(jax.random.key(0))
    x = (2 * jax.random.normal(kx, (4, 8, 64), jnp.float32) + 0.3).astype(dtype)
    scale = 1 + 0.1 * jax.random.normal(ks, (64,), jnp.float32)
    norm = maxtext_standin.RMSNorm(64, epsilon=peers.MAXTEXT_EPS, dtype=dtype, rngs=nnx.Rngs(0))
    norm.scale.set_value(scale)
    np.testing.assert_array_equal(
        np.asarray(peers.maxtext_formula(x, scale), np.float32), np.asarray(norm(x), np.float32)
    )


def test_logits_with_maxtexts_norm_and_ours_agree_in_float32():
    """The same formula in float32: the swap changes no logit beyond rounding, on
    trained-like scales (a scale that is wrong by its offset moves them far)."""
    params = models.maxtext_init_params(F32, jax.random.key(0), scan=False, norm_scale_std=0.3)
    tokens, _ = _tokens(F32)

    @jax.jit
    def logits(params, tokens):
        ours, theirs = peers.maxtext_ours, peers.maxtext_formula
        norms = (ours, theirs, lambda x, s: ours(x, s - 1.0))
        return [models.maxtext_logits(F32, n, params, tokens, scan=False) for n in norms]

    ours, theirs, wrong = logits(params, tokens)
    assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert float(jnp.max(jnp.abs(wrong - theirs))) > 0.1


def test_scanned_and_unrolled_layers_agree():
    """The same parameters, stacked under ``lax.scan`` or a list of layers: the same logits
    (float32) and the same loss and update in the bfloat16 train step."""
    unrolled = models.maxtext_init_params(TINY, jax.random.key(0), scan=False, norm_scale_std=0.3)
    stacked = _stacked(unrolled)
    tokens, targets = _tokens(TINY)
    f32 = [
        models.maxtext_logits(F32, peers.maxtext_ours, p, tokens, scan=s)
        for p, s in ((unrolled, False), (stacked, True))
    ]
    assert_close(f32[0], f32[1], rtol=1e-5, atol=1e-5)
    results = {}
    for scan, params in ((False, unrolled), (True, stacked)):
        step = jax.jit(models.maxtext_train_step(TINY, peers.maxtext_ours, scan))
        new, _, loss = step(params, models.maxtext_optimizer().init(params), tokens, targets)
        results[scan] = (float(loss), new)
    assert np.isfinite(results[False][0])
    assert results[False][0] == pytest.approx(results[True][0], rel=1e-3)
    restacked = _stacked(results[False][1])
    pairs = zip(jax.tree.leaves(restacked), jax.tree.leaves(results[True][1]), strict=True)
    for a, b in pairs:
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
@pytest.mark.parametrize("remat", ["full", "minimal"])
def test_each_remat_policy_gives_the_gradients_of_none(remat, scan):
    """Remat recomputes, it does not change the maths: float32 gradients of every
    parameter as without checkpointing (ours: its custom_vjp under jax.checkpoint)."""
    params = models.maxtext_init_params(F32, jax.random.key(0), scan=scan, norm_scale_std=0.3)
    tokens, targets = _tokens(F32)

    @jax.jit
    def grads(params):
        return [
            jax.grad(
                lambda p, policy=policy: models.maxtext_loss(
                    F32, peers.maxtext_ours, p, tokens, targets, scan, policy
                )
            )(params)
            for policy in (remat, "none")
        ]

    checkpointed, plain = grads(params)
    for a, b in zip(jax.tree.leaves(checkpointed), jax.tree.leaves(plain), strict=True):
        assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_an_unknown_remat_policy_is_refused():
    with pytest.raises(ValueError, match="full"):
        models.remat_policy("save_everything")


def test_quick_cli_writes_a_smoke_run(tmp_path):
    """``maxtext --quick --target h100`` (here scanned layers, remat full: MaxText's
    default) writes its table and JSON, labelled a smoke run, with ours over MaxText's."""
    reason = deviceless_skip_reason("h100")
    if reason:
        pytest.skip(reason)
    argv = ["maxtext", "--quick", "--target", "h100", "--modes", "scan", "--remats", "full"]
    saved = cli.main(argv)
    out = Path(saved["out"])
    try:
        text = (out / f"{saved['stem']}.md").read_text()
        assert saved["stem"] == f"maxtext-h100-jax{jax.__version__}-quick"
        assert text.startswith("**smoke run: not a measurement**")
        assert "not a hardware timing" in text
        assert [r["norm"] for r in saved["records"]] == list(peers.MAXTEXT_NORMS)
        ours = saved["records"][0]
        assert ours["fits"] and ours["temp_bytes_vs_maxtext"] > 0
        assert "| scan | full |" in text
        assert (out / f"{saved['stem']}.json").exists()
    finally:
        for path in out.iterdir():
            path.unlink()
        out.rmdir()
