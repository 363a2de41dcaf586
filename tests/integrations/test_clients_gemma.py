"""``patch_gemma()`` against Google DeepMind's ``gemma`` library (tested with gemma 4.0.1).

Skipped where gemma is not installed (it needs Python >= 3.12); ``.ci/clients.sh``
installs it at the pinned version in its own environment and runs this file. The oracle
is gemma's own model, unpatched, on the same parameters: a tiny Gemma 3 and Gemma 4
transformer (2 layers, d 64) with checkpoint-like parameters, float32 logits and
gradients, every norm call reached (counted on the unpatched model by flax's method
interceptor), the parameter tree of ``init`` unchanged, ``undo()`` bit for bit, through
gemma's ``nn.jit`` trace cache both ways; bfloat16 no farther from float32 than gemma's own.
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import grad_rel, rel, rel_l2

from rmsnorm_jax import integrations

pytestmark = pytest.mark.clients

with warnings.catch_warnings():
    # gemma imports SWIG-built modules (sentencepiece), which Python 3.12 warns about.
    warnings.filterwarnings("ignore", "builtin type .* has no __module__", DeprecationWarning)
    pytest.importorskip(
        "gemma", reason="gemma is not installed (.ci/clients.sh: 4.0.1, Python 3.12)"
    )
    from gemma import gm
    from gemma.gm.nn import _config as config3
    from gemma.gm.nn import _layers as layers3
    from gemma.gm.nn import _modules as modules3
    from gemma.gm.nn.gemma3n import _layers as layers3n
    from gemma.gm.nn.gemma4 import _config as config4
    from gemma.gm.nn.gemma4 import _layers as layers4
    from gemma.gm.nn.gemma4 import _modules as modules4
    from gemma.gm.nn.gemma4 import _transformer as transformer4
    from gemma.gm.nn.gemma4.vision import _norms as vision4

F32, BF16 = jnp.float32, jnp.bfloat16
VOCAB, DIM, HIDDEN = 128, 64, 128
F32_RTOL = 5e-6
NORM_CLASSES = (layers3.RMSNorm, layers4.RMSNorm, vision4.RMSNorm, layers3n.RMSNorm)
TOKENS = jnp.asarray(np.random.default_rng(1).integers(1, VOCAB, (2, 8)))


def build(family, dtype=F32):
    common = dict(
        num_embed=VOCAB,
        embed_dim=DIM,
        hidden_dim=HIDDEN,
        num_heads=2,
        head_dim=32,
        num_kv_heads=1,
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        sliding_window_size=4,
    )
    if family == "gemma3":
        local, glob = modules3.AttentionType.LOCAL_SLIDING, modules3.AttentionType.GLOBAL
        cfg = config3.TransformerConfig(
            final_logit_softcap=None,
            use_qk_norm=True,
            attention_types=(local, glob),
            transpose_gating_einsum=True,
            **common,
        )
        return gm.nn.Transformer(config=cfg, dtype=dtype)
    local, glob = modules4.AttentionType.LOCAL_SLIDING, modules4.AttentionType.GLOBAL
    cfg = config4.TransformerConfig(
        final_logit_softcap=30.0,
        attention_types=(local, glob),
        global_key_size=32,
        global_rope_proportion=0.25,
        local_rope_proportion=1.0,
        **common,
    )
    return transformer4.Transformer(config=cfg, dtype=dtype)


def params_of(model, family):
    """``init``'s parameters with ``0.1 * N(0, 1)`` added to each (checkpoint-like: the
    zero-centred scales away from 0, the others away from 1), drawn once per family."""
    params = model.init(jax.random.key(0), TOKENS)["params"]
    rng = np.random.default_rng(sum(map(ord, family)))
    return jax.tree.map(
        lambda a: jnp.asarray(np.asarray(a, F32) + 0.1 * rng.standard_normal(a.shape), a.dtype),
        params,
    )


def logits(model, params):
    return model.apply({"params": params}, TOKENS).logits


def loss_and_grads(model, params):
    def loss(params):
        out = logits(model, params)
        logp = jax.nn.log_softmax(out[:, :-1].astype(F32))
        return -jnp.take_along_axis(logp, TOKENS[:, 1:, None], axis=-1).mean(), out

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


def norm_calls(model, params):
    """The norm calls of one forward pass of the unpatched model, counted by flax's
    method interceptor (independent of the patch's own count)."""
    count = 0

    def interceptor(f, args, kwargs, context):
        nonlocal count
        count += isinstance(context.module, NORM_CLASSES) and context.method_name == "__call__"
        return f(*args, **kwargs)

    jax.clear_caches()  # gemma's nn.jit would reuse a trace and call nothing
    with nn.intercept_methods(interceptor):
        jax.eval_shape(lambda p: logits(model, p), params)
    return count


@pytest.fixture(autouse=True)
def _restore():
    yield
    integrations.unpatch_gemma()


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_float32_logits_and_gradients_are_gemmas(family, client_record):
    model = build(family)
    params = params_of(model, family)
    init0 = model.init(jax.random.key(0), TOKENS)["params"]
    expected_calls = norm_calls(model, params)
    (loss0, logits0), grads0 = loss_and_grads(model, params)  # gemma's nn.jit caches it
    patch = integrations.patch_gemma()
    (loss1, logits1), grads1 = loss_and_grads(model, params)

    assert patch.calls == expected_calls == {"gemma3": 13, "gemma4": 15}[family], repr(patch)
    assert logits1.dtype == logits0.dtype
    assert rel(logits1, logits0) <= F32_RTOL
    assert rel(loss1, loss0) <= F32_RTOL
    flat0, flat1 = jax.tree.leaves_with_path(grads0), jax.tree.leaves(grads1)
    largest = max(float(jnp.max(jnp.abs(g))) for _, g in flat0)
    for (path, g0), g1 in zip(flat0, flat1, strict=True):
        assert g1.dtype == g0.dtype, path
        difference = grad_rel(g1, g0, largest)
        assert difference <= F32_RTOL, (jax.tree_util.keystr(path), difference)
    worst = max(grad_rel(g1, g0, largest) for (_, g0), g1 in zip(flat0, flat1, strict=True))
    client_record(
        library="gemma", family=family, f32_logits=rel(logits1, logits0), f32_gradients=worst
    )

    # init under the patch: the same tree, shapes, dtypes and values (checkpoints load).
    fresh = model.init(jax.random.key(0), TOKENS)["params"]
    assert jax.tree.structure(fresh) == jax.tree.structure(init0)
    jax.tree.map(np.testing.assert_array_equal, fresh, init0)

    patch.undo()  # the next call traces gemma's own method again
    (_, logits2), grads2 = loss_and_grads(model, params)
    np.testing.assert_array_equal(logits2, logits0)
    jax.tree.map(np.testing.assert_array_equal, grads2, grads0)


def test_families_patches_those_and_leaves_the_others_gemmas():
    from gemma.gm.nn import _layers
    from gemma.gm.nn.gemma4 import _layers as gemma4_layers

    own = (_layers.RMSNorm.__dict__["__call__"], gemma4_layers.RMSNorm.__dict__["__call__"])
    model3, model4 = build("gemma3"), build("gemma4")
    params3, params4 = params_of(model3, "gemma3"), params_of(model4, "gemma4")
    with integrations.patch_gemma(families="gemma4") as patch:
        assert patch.targets == ("gemma.gm.nn.gemma4._layers.RMSNorm.__call__",)
        assert _layers.RMSNorm.__dict__["__call__"] is own[0]
        logits(model3, params3)
        assert patch.calls == 0, repr(patch)  # Gemma 3 keeps gemma's norm
        logits(model4, params4)
        assert patch.calls > 0, repr(patch)
    assert gemma4_layers.RMSNorm.__dict__["__call__"] is own[1]
    with pytest.raises(ValueError, match=r"names 'gemma5'.*'gemma3', 'gemma4'"):
        integrations.patch_gemma(families=("gemma5",))


def test_the_nn_jit_cache_follows_the_patch():
    """The issue's trap: gemma's ``Transformer.__call__`` is ``nn.jit`` with the model
    static, so a model that has run keeps its trace. Patching and undoing drop it."""
    model = build("gemma3")
    params = params_of(model, "gemma3")
    theirs = logits(model, params)
    reached = []
    for _ in range(2):
        with integrations.patch_gemma() as patch:
            ours = logits(model, params)
            reached.append(patch.calls)
        np.testing.assert_array_equal(logits(model, params), theirs)
    assert reached == [13, 13]
    assert rel(ours, theirs) <= F32_RTOL


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_bfloat16_as_near_float32_as_gemmas(family, client_record):
    model16 = build(family, BF16)
    params16 = jax.tree.map(lambda a: a.astype(BF16), params_of(build(family), family))
    reference = logits(build(family), jax.tree.map(lambda a: a.astype(F32), params16))
    theirs = logits(model16, params16)
    with integrations.patch_gemma() as patch:
        ours = logits(model16, params16)
        assert patch.calls > 0
    assert ours.dtype == theirs.dtype
    err_ours, err_theirs = rel_l2(ours, reference), rel_l2(theirs, reference)
    client_record(library="gemma", family=family, bf16_ours=err_ours, bf16_theirs=err_theirs)
    assert err_ours <= 1.1 * err_theirs + 1e-3, (err_ours, err_theirs)


CLASS_VARIANTS = [
    (layers3.RMSNorm, {}),
    (layers4.RMSNorm, {}),
    (layers4.RMSNorm, {"with_scale": False}),
    (vision4.RMSNorm, {}),
    (layers3n.RMSNorm, {}),
    (layers3n.RMSNorm, {"scale_plus_one": False, "scale_init": nn.initializers.ones}),
    (layers3n.RMSNorm, {"with_scale": False}),
    (layers3n.RMSNorm, {"guard_against_excess_precision": True}),
]


@pytest.mark.parametrize(
    ("cls", "fields"),
    CLASS_VARIANTS,
    ids=[f"{c.__module__.split('.', 3)[-1]}-{'-'.join(f) or 'default'}" for c, f in CLASS_VARIANTS],
)
def test_every_norm_class_is_gemmas_in_float64(x64, cls, fields):
    norm = cls(**fields)
    x = jnp.asarray(1.5 * np.random.default_rng(2).standard_normal((3, 5, 16)) + 0.2)
    init0 = norm.init(jax.random.key(0), x)
    rng = np.random.default_rng(3)
    variables = jax.tree.map(lambda a: a + 0.1 * rng.standard_normal(a.shape), init0)
    grad = jax.grad(lambda v, x: (norm.apply(v, x) * x).sum(), argnums=(0, 1))
    theirs, g_theirs = norm.apply(variables, x), grad(variables, x)
    with integrations.patch_gemma() as patch:
        ours, g_ours = norm.apply(variables, x), grad(variables, x)
        init1 = norm.init(jax.random.key(0), x)
    assert jax.tree.structure(init1) == jax.tree.structure(init0)
    jax.tree.map(np.testing.assert_array_equal, init1, init0)
    assert patch.calls == 3
    assert ours.dtype == theirs.dtype == jnp.float64
    np.testing.assert_allclose(ours, theirs, rtol=1e-13, atol=1e-13)
    for a, b in zip(jax.tree.leaves(g_ours), jax.tree.leaves(g_theirs), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_patch_gemma_targets_and_undo():
    own = [c.__dict__["__call__"] for c in NORM_CLASSES]
    with integrations.patch_gemma() as patch:
        assert patch.targets == tuple(f"{c.__module__}.RMSNorm.__call__" for c in NORM_CLASSES)
        assert "reached nothing" in repr(patch)
        integrations.patch_gemma()
        assert layers3.RMSNorm.__dict__["__call__"].__rmsnorm_jax_original__ is own[0]
    assert [c.__dict__["__call__"] for c in NORM_CLASSES] == own
    integrations.patch_gemma()
    integrations.unpatch_gemma()
    assert [c.__dict__["__call__"] for c in NORM_CLASSES] == own
