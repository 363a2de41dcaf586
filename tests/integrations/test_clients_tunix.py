"""``patch_tunix()`` against google-tunix's own models (tested with google-tunix 0.1.7).

Skipped where tunix is not installed; ``.ci/clients.sh`` installs it at the pinned version
and runs this file. The oracle is tunix's own model, unpatched, on the same parameters:
per family a tiny model (2 layers, d 64) with checkpoint-like norm parameters (not the
initializer's zeros or ones, which hide a missing ``1 +``), float32 logits and gradients
of a next-token loss compared, every norm instance reached once per trace, the parameter
tree untouched, ``undo()`` giving back tunix's outputs bit for bit; bfloat16 logits no
farther from the float32 ones than tunix's own; one step of tunix's ``PeftTrainer``.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import grad_rel, rel, rel_l2

from rmsnorm_jax import integrations
from rmsnorm_jax.integrations import _tunix

pytest.importorskip("tunix", reason="google-tunix is not installed (.ci/clients.sh installs 0.1.7)")

with warnings.catch_warnings():
    # tunix 0.1.7's gemma4 imports jax.experimental.shard_map (deprecated since jax 0.8).
    warnings.filterwarnings("ignore", "jax.experimental.shard_map", DeprecationWarning)
    from tunix.models.gemma import model as gemma
    from tunix.models.gemma3 import model as gemma3
    from tunix.models.gemma4 import model as gemma4
    from tunix.models.llama3 import model as llama3
    from tunix.models.qwen2 import model as qwen2
    from tunix.models.qwen3 import model as qwen3

# What tunix 0.1.7 does that flax 0.12 deprecates (not ours: every other warning fails).
pytestmark = [
    pytest.mark.clients,
    pytest.mark.filterwarnings("ignore:'sharding' is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:'.value' access is now deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings(
        "ignore:jax.interpreters.pxla.thread_resources is deprecated:DeprecationWarning"
    ),
]

F32, BF16 = jnp.float32, jnp.bfloat16
VOCAB, DIM, HIDDEN, LAYERS = 128, 64, 128, 2
BATCH, LENGTH = 2, 8
# float32 logits and gradients against tunix's own: the same formula, computed in another
# order (rsqrt and one multiply against sqrt and a division): a few roundings, amplified by
# the layers. Measured here: at most 1.1e-6 (llama3's gradients).
F32_RTOL = 5e-6

MODULES = {
    "gemma": gemma,
    "gemma3": gemma3,
    "gemma4": gemma4,
    "llama3": llama3,
    "qwen2": qwen2,
    "qwen3": qwen3,
}


def config(family, dtype):
    """A tiny config of the family; ``dtype`` bfloat16 gives its bfloat16 set-up (the
    config's param_dtype for gemma3, activation dtype for gemma4 and qwen; gemma and
    llama3 have neither: their parameters are cast)."""
    common = dict(embed_dim=DIM, hidden_dim=HIDDEN, num_heads=2, head_dim=32, num_kv_heads=1)
    if family == "gemma":
        return gemma.ModelConfig(
            num_layers=LAYERS,
            num_embed=VOCAB,
            final_logit_softcap=None,
            use_post_attn_norm=True,
            use_post_ffw_norm=True,
            attention_types=(gemma.AttentionType.GLOBAL,) * LAYERS,
            **common,
        )
    if family == "gemma3":
        return gemma3.ModelConfig(
            num_layers=LAYERS, num_embed=VOCAB, sliding_window_size=4, param_dtype=dtype, **common
        )
    if family == "gemma4":
        return gemma4.ModelConfig(
            num_layers=LAYERS,
            num_embed=VOCAB,
            sliding_window_size=4,
            global_key_size=32,
            dtype=dtype,
            param_dtype=F32,
            **common,
        )
    eps = {"norm_eps": 1e-5, "rope_theta": 10_000, "num_layers": LAYERS, "vocab_size": VOCAB}
    if family == "llama3":
        return llama3.ModelConfig(**eps, **common)
    return MODULES[family].ModelConfig(**eps, dtype=dtype, param_dtype=F32, **common)


def model_class(family):
    names = {"gemma": "Gemma", "gemma3": "Gemma3", "gemma4": "Gemma4"}
    return getattr(MODULES[family], names.get(family, family.capitalize()))


def norms(model):
    """The tunix norm instances of ``model``."""
    classes = tuple(m.RMSNorm for m in MODULES.values())
    return [node for _, node in nnx.iter_graph(model) if isinstance(node, classes)]


def build(family, dtype=F32):
    """The family's tiny model with checkpoint-like parameters: ``0.1 * N(0, 1)`` added to
    every one, drawn once per family (zero-centred scales away from 0, the others away
    from 1; tunix initializes some MLP kernels to zeros, which would leave the norms
    before them without a gradient)."""
    model = model_class(family)(config(family, dtype), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(sum(map(ord, family)))
    state = nnx.state(model, nnx.Param)
    noisy = lambda a: (np.asarray(a, np.float32) + 0.1 * rng.standard_normal(a.shape)).astype(
        a.dtype
    )
    nnx.update(model, jax.tree.map(lambda a: jnp.asarray(noisy(a)), state))
    return model


def inputs():
    tokens = jnp.asarray(np.random.default_rng(1).integers(1, VOCAB, (BATCH, LENGTH)))
    positions = jnp.broadcast_to(jnp.arange(LENGTH), (BATCH, LENGTH))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((LENGTH, LENGTH), bool)), (BATCH, LENGTH, LENGTH))
    return tokens, positions, mask


def loss_and_grads(model):
    """(loss, logits), gradients of the next-token loss w.r.t. every parameter, under a
    jit traced now (``patch_tunix`` drops earlier traces; so does this fresh function)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens, positions, mask = inputs()

    def loss(params):
        logits, _ = nnx.merge(graphdef, params, rest)(tokens, positions, None, mask)
        logp = jax.nn.log_softmax(logits[:, :-1].astype(F32))
        nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)
        return nll.mean(), logits

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


def signature(model):
    """The parameter tree as a checkpoint sees it: paths, shapes, dtypes, values."""
    return jax.tree.map(
        lambda a: (a.shape, str(a.dtype), np.asarray(a, np.float32).tobytes()),
        nnx.to_pure_dict(nnx.state(model, nnx.Param)),
    )


@pytest.fixture(autouse=True)
def _restore():
    yield
    integrations.unpatch_tunix()


@pytest.mark.parametrize("family", list(MODULES))
def test_float32_logits_and_gradients_are_tunixs(family, client_record):
    model = build(family)
    before = signature(model)
    (loss0, logits0), grads0 = loss_and_grads(model)
    patch = integrations.patch_tunix()
    (loss1, logits1), grads1 = loss_and_grads(model)

    # Every norm of the model went through rms_norm, once in the one trace.
    cls = f"{MODULES[family].__name__}.RMSNorm.__call__"
    assert patch.calls_by_target[cls] == len(norms(model)) == patch.calls, repr(patch)
    assert f"{patch.calls} norm calls through rms_norm" in repr(patch)
    assert logits1.dtype == logits0.dtype
    assert rel(logits1, logits0) <= F32_RTOL
    assert rel(loss1, loss0) <= F32_RTOL
    largest = max(float(jnp.max(jnp.abs(g[...]))) for _, g in nnx.to_flat_state(grads0))
    worst = 0.0
    for path, g0 in nnx.to_flat_state(grads0):
        g1 = dict(nnx.to_flat_state(grads1))[path]
        assert g1.dtype == g0.dtype, path
        difference = grad_rel(g1[...], g0[...], largest)
        assert difference <= F32_RTOL, (path, difference)
        worst = max(worst, difference)
    client_record(
        library="tunix", family=family, f32_logits=rel(logits1, logits0), f32_gradients=worst
    )

    # The parameters are tunix's: untouched by the patched calls, and a model built under
    # the patch has the same tree and values (checkpoints load unchanged).
    assert signature(model) == before
    assert signature(build(family)) == before

    patch.undo()
    (_, logits2), grads2 = loss_and_grads(model)
    np.testing.assert_array_equal(logits2, logits0)
    for (path, g0), (_, g2) in zip(
        nnx.to_flat_state(grads0), nnx.to_flat_state(grads2), strict=True
    ):
        np.testing.assert_array_equal(g2[...], g0[...], err_msg=str(path))


def logits_of(model):
    tokens, positions, mask = inputs()
    return nnx.jit(lambda m: m(tokens, positions, None, mask)[0])(model)


@pytest.mark.parametrize("family", list(MODULES))
def test_bfloat16_logits_as_near_float32_as_tunixs(family, client_record):
    """The family's bfloat16 set-up, patched and not, against the float32 model on the
    same (bfloat16-rounded) parameters: ours keeps the output dtypes and is no farther
    from float32 arithmetic than tunix's own norm (it rounds once, where tunix's gemma
    norms keep bfloat16 statistics)."""
    model16 = build(family, BF16)
    if family in ("gemma", "llama3"):  # no dtype in the config: bfloat16 parameters
        state = nnx.state(model16, nnx.Param)
        nnx.update(model16, jax.tree.map(lambda a: a.astype(BF16), state))
    reference = build(family)
    state16 = nnx.state(model16, nnx.Param)
    nnx.update(reference, jax.tree.map(lambda a: a.astype(F32), state16))
    logits32 = logits_of(reference)
    theirs = logits_of(model16)
    with integrations.patch_tunix() as patch:
        ours = logits_of(model16)
        assert patch.calls == len(norms(model16)), repr(patch)
    assert ours.dtype == theirs.dtype
    err_ours, err_theirs = rel_l2(ours, logits32), rel_l2(theirs, logits32)
    client_record(library="tunix", family=family, bf16_ours=err_ours, bf16_theirs=err_theirs)
    assert err_ours <= 1.1 * err_theirs + 1e-3, (err_ours, err_theirs)


def test_patch_reaches_every_family_and_undoes():
    own = {f: m.RMSNorm.__dict__["__call__"] for f, m in MODULES.items()}
    with integrations.patch_tunix() as patch:
        assert patch.targets == tuple(f"{m.__name__}.RMSNorm.__call__" for m in MODULES.values())
        assert "reached nothing" in repr(patch)
        assert all(m.RMSNorm.__dict__["__call__"] is not own[f] for f, m in MODULES.items())
        integrations.patch_tunix()  # again: replaces, never wraps
        assert gemma3.RMSNorm.__call__.__rmsnorm_jax_original__ is own["gemma3"]
    assert {f: m.RMSNorm.__dict__["__call__"] for f, m in MODULES.items()} == own
    integrations.patch_tunix()
    integrations.unpatch_tunix()
    assert {f: m.RMSNorm.__dict__["__call__"] for f, m in MODULES.items()} == own


def test_families_patches_those_and_leaves_the_others_tunixs():
    own = {f: m.RMSNorm.__dict__["__call__"] for f, m in MODULES.items()}
    with integrations.patch_tunix(families=("llama3", "qwen3")) as patch:
        assert patch.targets == tuple(
            f"{MODULES[f].__name__}.RMSNorm.__call__" for f in ("llama3", "qwen3")
        )
        changed = {f for f, m in MODULES.items() if m.RMSNorm.__dict__["__call__"] is not own[f]}
        assert changed == {"llama3", "qwen3"}
        logits_of(build("gemma3"))
        assert patch.calls == 0, repr(patch)  # gemma3 keeps tunix's norm
        model = build("llama3")
        logits_of(model)
        assert patch.calls == len(norms(model)), repr(patch)
    assert {f: m.RMSNorm.__dict__["__call__"] for f, m in MODULES.items()} == own
    with pytest.raises(ValueError, match=r"families=\('llama4',\) names 'llama4'.*'qwen3'"):
        integrations.patch_tunix(families="llama4")
    with pytest.raises(ValueError, match="names none"):
        integrations.patch_tunix(families=())
    assert {f: m.RMSNorm.__dict__["__call__"] for f, m in MODULES.items()} == own


def _without_offset(original, implementation, hit):
    """What a hand-written patch of tunix gemma3 without ``scale_offset=1.0`` computes."""
    from rmsnorm_jax import rms_norm

    def __call__(self, x):
        return rms_norm(x, self.scale[...], 1e-6)

    return __call__


def _without_dtype(original, implementation, hit):
    """A hand-written patch of tunix qwen3 without ``dtype=self.dtype``."""
    from rmsnorm_jax import rms_norm

    def __call__(self, x):
        return rms_norm(x, self.w[...], self.norm_eps)

    return __call__


@pytest.mark.parametrize(
    ("family", "make", "message"),
    [
        ("gemma3", _without_offset, r"float32 outputs differ by 0\.\d+ relative"),
        ("qwen3", _without_dtype, r"ours gives .*float32.* where the library gives .*bfloat16"),
    ],
)
def test_a_wrong_replacement_is_refused(monkeypatch, family, make, message):
    """The issue's silent failures: the probe refuses them, naming the class."""
    own = {f: m.RMSNorm.__dict__["__call__"] for f, m in MODULES.items()}
    builders = _tunix._FAMILIES[family][1]
    monkeypatch.setitem(_tunix._FAMILIES, family, (make, builders))
    with pytest.raises(RuntimeError, match=rf"refused {MODULES[family].__name__}\.RMSNorm") as err:
        integrations.patch_tunix()
    assert err.match(message)
    assert {f: m.RMSNorm.__dict__["__call__"] for f, m in MODULES.items()} == own


def test_a_checkpoint_loads_into_the_patched_model():
    """The issue's llama3 trap: an adapter that renames ``w`` to ``scale`` takes a stray
    ``w`` from ``nnx.update`` and leaves its own at ones. Here the parameter stays ``w``."""
    trained = build("llama3")
    fresh = model_class("llama3")(config("llama3", F32), rngs=nnx.Rngs(5))
    expected = logits_of(trained)
    with integrations.patch_tunix() as patch:
        nnx.update(fresh, nnx.state(trained, nnx.Param))
        got = logits_of(fresh)
        assert patch.calls == len(norms(fresh))
    assert rel(got, expected) <= F32_RTOL


@pytest.mark.filterwarnings("ignore:optax.global_norm is deprecated:DeprecationWarning")
def test_one_peft_trainer_step():
    """One step of tunix's own trainer (full fine-tuning, SGD), patched and not, from the
    same parameters: the updated parameters agree to float32 rounding."""
    import optax
    from tunix.sft import peft_trainer, utils

    tokens, _, _ = inputs()

    def gen_model_input_fn(x):
        pad_mask = x.input_tokens != 0
        return {
            "input_tokens": x.input_tokens,
            "input_mask": x.input_mask,
            "positions": utils.build_positions_from_mask(pad_mask),
            "attention_mask": utils.make_causal_attn_mask(pad_mask),
        }

    def one_step(model):
        trainer = peft_trainer.PeftTrainer(
            model,
            optax.sgd(0.5),
            peft_trainer.TrainingConfig(eval_every_n_steps=100, max_steps=1),
        ).with_gen_model_input_fn(gen_model_input_fn)
        batch = peft_trainer.TrainingInput(input_tokens=tokens, input_mask=jnp.ones_like(tokens))
        trainer.train([batch])
        return nnx.state(model, nnx.Param)

    start = nnx.state(build("gemma3"), nnx.Param)
    theirs = one_step(build("gemma3"))
    with integrations.patch_tunix() as patch:
        ours = one_step(build("gemma3"))
        assert patch.calls > 0, repr(patch)
    moved = 0
    largest = max(
        float(np.max(np.abs(np.asarray(t[...], np.float64) - np.asarray(s[...], np.float64))))
        for (_, t), (_, s) in zip(nnx.to_flat_state(theirs), nnx.to_flat_state(start), strict=True)
    )
    for (path, t), (_, o), (_, s) in zip(
        nnx.to_flat_state(theirs), nnx.to_flat_state(ours), nnx.to_flat_state(start), strict=True
    ):
        step = np.asarray(t[...], np.float64) - np.asarray(s[...], np.float64)
        moved += bool(np.any(step != 0))
        # The steps (parameters after minus before) compared as gradients are.
        ours_step = np.asarray(o[...], np.float64) - np.asarray(s[...], np.float64)
        assert grad_rel(ours_step, step, largest) <= F32_RTOL, path
    assert moved > 0  # the step changed the parameters
