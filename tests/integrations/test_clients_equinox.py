"""``patch_equinox()`` against ``equinox.nn.RMSNorm`` (tested with equinox 0.13.8).

Skipped where equinox is not installed; ``.ci/clients.sh`` installs it at the pinned
version and runs this file. The oracle is equinox's own module, unpatched, on the same
parameters (float64 where x64 is on): a tiny pre-norm language model built from equinox's
layers (its norms vmapped over tokens, as equinox's users do, bias on by default, one norm
over a whole ``(tokens, features)`` sequence), float32 logits and gradients, every norm
reached, the parameters untouched, ``undo()`` bit for bit; bfloat16 no farther from
float32 than equinox's own.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import grad_rel, rel

from rmsnorm_jax import integrations
from rmsnorm_jax.integrations._patch import trained_like

pytestmark = pytest.mark.clients

eqx = pytest.importorskip("equinox", reason="equinox is not installed (.ci/clients.sh: 0.13.8)")

F32, BF16 = jnp.float32, jnp.bfloat16
VOCAB, DIM, LENGTH, LAYERS = 64, 32, 8, 2
F32_RTOL = 5e-6


class Block(eqx.Module):
    norm1: eqx.nn.RMSNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.RMSNorm
    mlp: eqx.nn.MLP

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.norm1 = eqx.nn.RMSNorm(DIM)
        self.attention = eqx.nn.MultiheadAttention(2, DIM, key=k1)
        self.norm2 = eqx.nn.RMSNorm(DIM, use_bias=False)
        self.mlp = eqx.nn.MLP(DIM, DIM, 2 * DIM, 1, activation=jax.nn.gelu, key=k2)

    def __call__(self, x):
        h = jax.vmap(self.norm1)(x)
        causal = jnp.tril(jnp.ones((LENGTH, LENGTH), bool))
        x = x + self.attention(h, h, h, mask=causal)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class LM(eqx.Module):
    embedding: eqx.nn.Embedding
    blocks: list
    sequence_norm: eqx.nn.RMSNorm  # over all of (tokens, features): equinox's own shape
    final_norm: eqx.nn.RMSNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, LAYERS + 2)
        self.embedding = eqx.nn.Embedding(VOCAB, DIM, key=keys[0])
        self.blocks = [Block(k) for k in keys[2:]]
        self.sequence_norm = eqx.nn.RMSNorm((LENGTH, DIM), eps=1e-6)
        self.final_norm = eqx.nn.RMSNorm(DIM)
        self.head = eqx.nn.Linear(DIM, VOCAB, key=keys[1])

    def __call__(self, tokens):
        x = jax.vmap(self.embedding)(tokens)
        for block in self.blocks:
            x = block(x)
        x = self.sequence_norm(x)
        return jax.vmap(self.head)(jax.vmap(self.final_norm)(x))


def build(dtype=F32):
    """The model, norms checkpoint-like (``0.1 * N(0, 1)`` added to weights and biases)."""
    model = LM(jax.random.key(0))
    norms = lambda m: [n for n in jax.tree.leaves(m, is_leaf=is_norm) if is_norm(n)]
    model = eqx.tree_at(norms, model, [trained_like(n) for n in norms(model)])
    return jax.tree.map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, model)


def is_norm(node):
    return isinstance(node, eqx.nn.RMSNorm)


def count_norms(model):
    return sum(map(is_norm, jax.tree.leaves(model, is_leaf=is_norm)))


TOKENS = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (LENGTH,)))


def loss(model):
    logits = model(TOKENS)
    logp = jax.nn.log_softmax(logits[:-1].astype(F32))
    return -jnp.take_along_axis(logp, TOKENS[1:, None], axis=-1).mean(), logits


@eqx.filter_jit
def loss_and_grads(model):
    return eqx.filter_value_and_grad(loss, has_aux=True)(model)


def arrays(model):
    return jax.tree.leaves(eqx.filter(model, eqx.is_array))


@pytest.fixture(autouse=True)
def _restore():
    yield
    integrations.unpatch_equinox()


def test_float32_logits_and_gradients_are_equinoxs(client_record):
    model = build()
    before = [np.asarray(a).copy() for a in arrays(model)]
    (loss0, logits0), grads0 = loss_and_grads(model)  # traced before the patch
    patch = integrations.patch_equinox()
    (loss1, logits1), grads1 = loss_and_grads(model)  # the same filter_jit function

    assert patch.calls == count_norms(model) == 2 * LAYERS + 2, repr(patch)
    assert logits1.dtype == logits0.dtype
    assert rel(logits1, logits0) <= F32_RTOL
    assert rel(loss1, loss0) <= F32_RTOL
    largest = max(float(jnp.max(jnp.abs(g))) for g in arrays(grads0))
    for g0, g1 in zip(arrays(grads0), arrays(grads1), strict=True):
        assert g1.dtype == g0.dtype and g1.shape == g0.shape
        assert grad_rel(g1, g0, largest) <= F32_RTOL
    pairs = zip(arrays(grads0), arrays(grads1), strict=True)
    worst = max(grad_rel(g1, g0, largest) for g0, g1 in pairs)
    client_record(
        library="equinox", family="LM", f32_logits=rel(logits1, logits0), f32_gradients=worst
    )
    for a, b in zip(arrays(model), before, strict=True):
        np.testing.assert_array_equal(a, b)

    patch.undo()
    (_, logits2), grads2 = loss_and_grads(model)
    np.testing.assert_array_equal(logits2, logits0)
    for g0, g2 in zip(arrays(grads0), arrays(grads2), strict=True):
        np.testing.assert_array_equal(g2, g0)


def test_bfloat16_as_near_float32_as_equinoxs(client_record):
    model32 = build()
    model16 = build(BF16)
    reference = jax.tree.map(
        lambda a: a.astype(F32) if eqx.is_inexact_array(a) else a, model16
    )  # float32 arithmetic on the bfloat16-rounded parameters
    logits32 = eqx.filter_jit(lambda m: m(TOKENS))(reference)
    theirs = eqx.filter_jit(lambda m: m(TOKENS))(model16)
    with integrations.patch_equinox() as patch:
        ours = eqx.filter_jit(lambda m: m(TOKENS))(model16)
        assert patch.calls == count_norms(model16)
    assert ours.dtype == theirs.dtype == BF16
    l2 = lambda y: float(jnp.linalg.norm(y.astype(F32) - logits32) / jnp.linalg.norm(logits32))
    client_record(library="equinox", family="LM", bf16_ours=l2(ours), bf16_theirs=l2(theirs))
    assert l2(ours) <= 1.1 * l2(theirs) + 1e-3
    del model32


@pytest.mark.parametrize(
    "options",
    [{}, {"use_bias": False}, {"use_weight": False, "use_bias": False}, {"eps": 0.5}],
    ids=["default", "no_bias", "no_weight_no_bias", "eps"],
)
@pytest.mark.parametrize("shape", [(16,), (3, 16), (2, 3, 4)], ids=str)
def test_every_option_and_shape_is_equinoxs_in_float64(x64, options, shape):
    norm = trained_like(eqx.nn.RMSNorm(shape, dtype=jnp.float64, **options))
    x = jnp.asarray(1.5 * np.random.default_rng(2).standard_normal(shape) + 0.2)
    theirs = norm(x)
    with integrations.patch_equinox() as patch:
        ours = norm(x)
        grad = jax.grad(lambda n, x: n(x).sum(), argnums=(0, 1))
        g_ours = grad(norm, x)
    g_theirs = grad(norm, x)
    assert patch.calls == 2
    assert ours.dtype == theirs.dtype == jnp.float64
    np.testing.assert_allclose(ours, theirs, rtol=1e-13, atol=1e-13)
    for a, b in zip(jax.tree.leaves(g_ours), jax.tree.leaves(g_theirs), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_state_and_errors_are_equinoxs():
    norm = eqx.nn.RMSNorm(8)
    state = object()
    with integrations.patch_equinox() as patch:
        y, same = norm(jnp.ones(8), state)
        assert same is state and y.shape == (8,)
        with pytest.raises(ValueError, match=r"jax\.vmap\(rms_norm\)"):
            norm(jnp.ones((2, 8)))  # equinox's own message: vmap over tokens
        assert patch.calls == 1
    assert "reached nothing" in repr(integrations.patch_equinox())


def test_patch_equinox_undo():
    own = eqx.nn.RMSNorm.__dict__["__call__"]
    with integrations.patch_equinox() as patch:
        assert patch.targets == ("equinox.nn._normalisation.RMSNorm.__call__",)
        integrations.patch_equinox()
        assert eqx.nn.RMSNorm.__dict__["__call__"].__rmsnorm_jax_original__ is own
    assert eqx.nn.RMSNorm.__dict__["__call__"] is own
    integrations.patch_equinox()
    integrations.unpatch_equinox()
    assert eqx.nn.RMSNorm.__dict__["__call__"] is own
