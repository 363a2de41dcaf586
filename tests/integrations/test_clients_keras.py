"""``patch_keras()`` against Keras 3 and KerasHub on JAX (tested with keras 3.15.1 and
keras-hub 0.32.0).

Skipped where keras or keras-hub is not installed; ``.ci/clients.sh`` installs them at the
pinned versions (keras-hub with ``--no-deps``, without TensorFlow) and runs this file. The
oracle is Keras's own model, unpatched, on the same parameters: per family a tiny backbone
built from arguments (2 layers, hidden 32, vocabulary 64) with checkpoint-like weights,
float32 outputs and the gradients of every trainable variable, every norm instance reached
once per trace, ``undo()`` bit for bit; a causal LM's ``fit`` (before and after
``enable_lora``), ``predict`` and ``generate`` through the patch, their compiled functions
built before it; ``mixed_bfloat16`` and ``bfloat16`` no farther from float32 than Keras's
own; Keras core's ``RMSNormalization`` in a functional model.
"""

import importlib.util
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

if "keras" not in sys.modules and importlib.util.find_spec("keras") is not None:
    os.environ["KERAS_BACKEND"] = "jax"  # Keras reads it once, at its first import

keras = pytest.importorskip("keras", reason="keras is not installed (.ci/clients.sh: 3.15.1)")
keras_hub = pytest.importorskip(
    "keras_hub", reason="keras-hub is not installed (.ci/clients.sh: 0.32.0, --no-deps)"
)

from helpers import aot_target, grad_rel, rel, rel_l2  # noqa: E402

from rmsnorm_jax import integrations  # noqa: E402
from rmsnorm_jax.integrations import _keras, _keras_classes  # noqa: E402


def call_of(cls: type) -> str:
    """The name a ``Patch`` gives the ``call`` of ``cls`` it replaces."""
    return f"{cls.__module__}.{cls.__qualname__}.call"


pytestmark = pytest.mark.clients

F32 = jnp.float32
VOCAB, HIDDEN, BATCH, LENGTH = 64, 32, 2, 8
# float32 outputs and gradients against Keras's own: the same formula in another order
# (gemma's reciprocal(sqrt) against rsqrt; one multiplication moved): a few roundings,
# amplified by the layers.
F32_RTOL = 5e-6

COMMON = dict(vocabulary_size=VOCAB, num_layers=2, hidden_dim=HIDDEN, intermediate_dim=64)
HEADS = dict(num_query_heads=2, num_key_value_heads=1)
M = keras_hub.models
# family: (backbone class, its arguments beyond COMMON). Llama 3 is a llama backbone.
BACKBONES = {
    "gemma": (M.GemmaBackbone, dict(**HEADS, head_dim=16, use_post_ffw_norm=True,
              use_post_attention_norm=True)),
    "gemma3": (M.Gemma3Backbone, dict(**HEADS, image_size=16, head_dim=16,
               use_post_ffw_norm=True, use_post_attention_norm=True,
               use_sliding_window_attention=True, sliding_window_size=4)),
    "gemma4": (M.Gemma4Backbone, dict(**HEADS, image_size=16, head_dim=16,
               sliding_window_size=4, sliding_window_pattern=2)),
    "llama": (M.Llama3Backbone, dict(**HEADS, layer_norm_epsilon=1e-5)),
    "mistral": (M.MistralBackbone, dict(**HEADS, sliding_window=4)),
    "mixtral": (M.MixtralBackbone, dict(**HEADS, num_experts=2, top_k=1)),
    "phi3": (M.Phi3Backbone, HEADS),
    "qwen": (M.QwenBackbone, HEADS),
    "qwen_moe": (M.QwenMoeBackbone, dict(**HEADS, moe_intermediate_dim=16,
                 shared_expert_intermediate_dim=16, num_experts=2, top_k=1)),
    "qwen3": (M.Qwen3Backbone, dict(**HEADS, head_dim=16)),
    "qwen3_moe": (M.Qwen3MoeBackbone, dict(**HEADS, head_dim=16, moe_intermediate_dim=16,
                  num_experts=2, top_k=1)),
    # Full attention only: a linear-attention layer (Qwen3_5RMSNormGated's) unrolls a loop
    # of 64 steps and takes a minute to compile; its norm is tested in test_norm_layers.
    "qwen3_5": (M.Qwen3_5Backbone, dict(**HEADS, head_dim=16,
                layer_types=["full_attention"] * 2)),
    "gpt_oss": (M.GptOssBackbone, dict(**HEADS, num_experts=2, top_k=2, head_dim=16)),
    "roformer_v2": (M.RoformerV2Backbone, dict(num_heads=2, head_size=16, dropout=0)),
}  # fmt: skip


def norm_classes():
    return tuple(cls for found in _keras_classes.classes().values() for _, cls in found)


def norms(model):
    """The instances of the patched classes in ``model`` (each runs once per call)."""
    classes = norm_classes()
    return [layer for layer in model._flatten_layers() if isinstance(layer, classes)]


def perturb(model, seed):
    """Every weight plus ``0.1 * N(0, 1)`` (checkpoint-like: the zero-centred scales away
    from 0, the others away from 1), drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    for v in model.weights:
        if keras.backend.is_float_dtype(v.dtype):
            value = np.asarray(v, np.float32) + 0.1 * rng.standard_normal(v.shape)
            v.assign(value.astype(keras.backend.standardize_dtype(v.dtype)))
    return model


def backbone(family, dtype="float32"):
    cls, kwargs = BACKBONES[family]
    keras.utils.set_random_seed(0)
    return perturb(cls(**COMMON, **kwargs, dtype=dtype), sum(map(ord, family)))


def inputs(family):
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, VOCAB, (BATCH, LENGTH)).astype("int32")
    padding = np.ones((BATCH, LENGTH), "int32")
    padding[1, -2:] = 0
    x = {"token_ids": tokens, "padding_mask": padding}
    if family == "gemma4":
        x["position_ids"] = np.broadcast_to(np.arange(LENGTH, dtype="int32"), tokens.shape)
    if family == "roformer_v2":
        x = {"token_ids": tokens, "segment_ids": np.zeros_like(tokens)}
    return x


def cotangent(model, x):
    """A fixed random projection of the outputs: the loss whose gradients are compared."""
    out = jax.eval_shape(lambda: model(x))
    rng = np.random.default_rng(2)
    return jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape), F32), out)


def loss_and_grads(model, x, weights):
    """(loss, outputs), the gradients of every trainable variable, under a jit traced now
    through ``model.stateless_call``."""
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def loss(trainable):
        out, _ = model.stateless_call(trainable, non_trainable, x)
        terms = jax.tree.map(lambda o, w: jnp.sum(o.astype(F32) * w), out, weights)
        return sum(jax.tree.leaves(terms)), out

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(trainable)


def own_calls():
    return {cls: cls.__dict__["call"] for cls in norm_classes()}


@pytest.fixture(autouse=True)
def _restore():
    yield
    integrations.unpatch_keras()


# ---------------------------------------------------------------- every family, float32


@pytest.mark.parametrize("family", list(BACKBONES))
def test_float32_outputs_and_gradients_are_keras(family, client_record):
    model = backbone(family)
    x = inputs(family)
    weights = cotangent(model, x)
    (loss0, out0), grads0 = loss_and_grads(model, x, weights)
    patch = integrations.patch_keras()
    (loss1, out1), grads1 = loss_and_grads(model, x, weights)

    # Every norm instance went through rms_norm, once in the one trace.
    instances = norms(model)
    assert instances, family
    assert patch.calls == len(instances), repr(patch)
    reached = {t for t, n in patch.calls_by_target.items() if n}
    assert reached == {call_of(type(n)) for n in instances}
    assert rel(loss1, loss0) <= F32_RTOL
    outputs = list(zip(jax.tree.leaves(out1), jax.tree.leaves(out0), strict=True))
    assert all(o1.dtype == o0.dtype for o1, o0 in outputs)
    out_difference = max(rel(o1, o0) for o1, o0 in outputs)
    assert out_difference <= F32_RTOL
    largest = max(float(jnp.max(jnp.abs(g))) for g in grads0)
    worst = 0.0
    for variable, g0, g1 in zip(model.trainable_variables, grads0, grads1, strict=True):
        assert g1.dtype == g0.dtype, variable.path
        difference = grad_rel(g1, g0, largest)
        assert difference <= F32_RTOL, (variable.path, difference)
        worst = max(worst, difference)
    assert len(grads0) == len(model.trainable_variables) > 0
    client_record(library="keras", family=family, f32_logits=out_difference, f32_gradients=worst)
    patch.undo()
    if family in ("gemma", "qwen3_5"):  # back to Keras's own, bit for bit
        (_, out2), grads2 = loss_and_grads(model, x, weights)
        jax.tree.map(np.testing.assert_array_equal, out2, out0)
        for g2, g0 in zip(grads2, grads0, strict=True):
            np.testing.assert_array_equal(g2, g0)


# ---------------------------------------------------------------- a causal LM's compiled functions


def causal_lm(family, lora=False):
    """A tiny causal LM (no preprocessor), compiled for ``fit`` with plain SGD (no
    optimizer state: two ``fit`` calls from the same weights take the same step) and a
    greedy sampler."""
    lm = {"gemma": M.GemmaCausalLM, "gemma3": M.Gemma3CausalLM}[family](
        backbone=backbone(family), preprocessor=None
    )
    if lora:
        lm.backbone.enable_lora(rank=2)
    lm.compile(
        optimizer=keras.optimizers.SGD(0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        sampler="greedy",
    )
    return lm


def batch():
    x = inputs("gemma3")
    y = np.roll(x["token_ids"], -1, axis=1)
    return x, y, x["padding_mask"].astype("float32")


def step(lm, weights0):
    """``fit`` for one step from ``weights0``; the new weights less ``weights0``.

    KerasHub's own ``fit`` and ``predict`` first turn NumPy inputs into a grain or tf.data
    dataset (neither is installed here) and apply the preprocessor (None here); then they
    call Keras's, which compiles the step: the tests call Keras's directly."""
    for variable, value in zip(lm.weights, weights0, strict=True):
        variable.assign(value)
    x, y, sample_weight = batch()
    keras.Model.fit(lm, x, y, sample_weight=sample_weight, batch_size=BATCH, verbose=0)
    after = [np.asarray(v, np.float64) for v in lm.weights]
    return [a - np.asarray(w, np.float64) for a, w in zip(after, weights0, strict=True)]


def assert_same_steps(ours, theirs):
    largest = max(float(np.max(np.abs(t))) for t in theirs)
    assert largest > 0  # the step changed the weights
    for o, t in zip(ours, theirs, strict=True):
        assert grad_rel(o, t, largest) <= F32_RTOL


def test_predict_generate_and_fit_compiled_before_the_patch_use_it():
    """The issue's trap: a model's predict, generate and train functions are jitted and
    kept; those built before the patch trace again and use it, and again after undo()."""
    lm = causal_lm("gemma")
    x, _, _ = batch()
    prompt = {"token_ids": x["token_ids"], "padding_mask": np.zeros_like(x["padding_mask"])}
    prompt["padding_mask"][:, :3] = 1
    weights0 = [np.asarray(v) for v in lm.weights]
    logits0 = keras.Model.predict(lm, x, verbose=0)
    generated0 = lm.generate(prompt, stop_token_ids=None)
    steps0 = step(lm, weights0)
    count = len(norms(lm))

    patch = integrations.patch_keras(families="gemma")
    for variable, value in zip(lm.weights, weights0, strict=True):
        variable.assign(value)
    logits1 = keras.Model.predict(lm, x, verbose=0)
    assert patch.calls == count, repr(patch)  # the same predict function, traced again
    generated1 = lm.generate(prompt, stop_token_ids=None)
    assert patch.calls > count, repr(patch)
    reached = patch.calls
    steps1 = step(lm, weights0)
    assert patch.calls > reached, repr(patch)  # the train function too

    assert rel(logits1, logits0) <= F32_RTOL
    np.testing.assert_array_equal(generated1["token_ids"], generated0["token_ids"])
    assert_same_steps(steps1, steps0)

    patch.undo()
    for variable, value in zip(lm.weights, weights0, strict=True):
        variable.assign(value)
    reached = patch.calls
    np.testing.assert_array_equal(keras.Model.predict(lm, x, verbose=0), logits0)
    assert patch.calls == reached


def test_enable_lora_then_fit():
    """LoRA as Gemma's fine-tuning guides do it: ``enable_lora`` freezes every other weight
    (the norms' scales too); the adapters' step under the patch is Keras's own."""
    lm = causal_lm("gemma3", lora=True)
    scales = [n.scale for n in norms(lm)]
    assert scales and not any(s.trainable for s in scales)
    assert lm.trainable_variables and all("lora" in v.path for v in lm.trainable_variables)
    weights0 = [np.asarray(v) for v in lm.weights]
    theirs = step(lm, weights0)
    with integrations.patch_keras(families="gemma3") as patch:
        ours = step(lm, weights0)
        assert patch.calls > 0, repr(patch)
    assert_same_steps(ours, theirs)
    lora = [i for i, v in enumerate(lm.weights) if "lora" in v.path]
    assert all(np.any(theirs[i] != 0) for i in lora if "lora_kernel_b" in lm.weights[i].path)
    assert not any(np.any(ours[i] != 0) for i, v in enumerate(lm.weights) if "scale" in v.path)


# ---------------------------------------------------------------- layers in a functional model

LAYERS = {  # family: the norm layers between dense layers (those no tiny backbone has)
    "keras": lambda: [
        keras.layers.RMSNormalization(epsilon=1e-5),
        keras.layers.RMSNormalization(axis=[-2, -1], epsilon=None),
    ],
    "qwen3_5": lambda: [_keras_hub_class("qwen3_5", "Qwen3_5RMSNormGated")(epsilon=1e-6)],
    "gemma4": lambda: [_keras_hub_class("gemma4", "Gemma4FrozenNorm")()],
}


def _keras_hub_class(family, name):
    (norm,) = [n for n in _keras.FAMILIES[family] if n.name == name]
    return getattr(sys.modules[norm.module], name)


def functional_model(family):
    """Keras's functional API: dense layers with the family's norm layers between them."""
    keras.utils.set_random_seed(3)
    inp = keras.Input((LENGTH, HIDDEN))
    h = keras.layers.Dense(HIDDEN)(inp)
    for norm in LAYERS[family]():
        h = keras.layers.Dense(HIDDEN, activation="gelu")(norm(h))
    return perturb(keras.Model(inp, keras.layers.Dense(4)(h)), 4)


@pytest.mark.parametrize("family", list(LAYERS))
def test_norm_layers_in_a_functional_model(family, client_record):
    """Keras core's RMSNormalization (its axes, epsilon=None) and the KerasHub classes the
    tiny backbones lack (Qwen 3.5's linear-attention norm, Gemma 4's frozen audio norm)."""
    model = functional_model(family)
    x = np.random.default_rng(5).standard_normal((BATCH, LENGTH, HIDDEN)).astype("float32")
    weights = cotangent(model, x)
    (_, out0), grads0 = loss_and_grads(model, x, weights)
    with integrations.patch_keras(families=family) as patch:
        (_, out1), grads1 = loss_and_grads(model, x, weights)
        assert patch.calls == len(LAYERS[family]()) == len(norms(model)), repr(patch)
        # A model built under the patch: the same outputs.
        np.testing.assert_array_equal(functional_model(family)(x), model(x))
    assert rel(out1, out0) <= F32_RTOL
    largest = max(float(jnp.max(jnp.abs(g))) for g in grads0)
    worst = max(grad_rel(g1, g0, largest) for g0, g1 in zip(grads0, grads1, strict=True))
    assert worst <= F32_RTOL
    client_record(
        library="keras",
        family=f"{family} layers",
        f32_logits=rel(out1, out0),
        f32_gradients=worst,
    )


# ---------------------------------------------------------------- bfloat16


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "bfloat16"])
@pytest.mark.parametrize("family", ["gemma3", "llama", "qwen3"])
def test_half_precision_as_near_float32_as_keras(family, policy, client_record):
    """The model under ``policy``, patched and not, against the float32 model on the same
    (for ``bfloat16``, bfloat16-rounded) weights: the output dtype is Keras's, and ours is
    no farther from float32 arithmetic than Keras's own norm."""
    model16 = backbone(family, policy)
    reference = backbone(family)
    for v32, v16 in zip(reference.weights, model16.weights, strict=True):
        v32.assign(np.asarray(v16, np.float32))
    x = inputs(family)
    expected = jax.jit(lambda: reference(x))()
    theirs = jax.jit(lambda: model16(x))()
    with integrations.patch_keras() as patch:
        ours = jax.jit(lambda: model16(x))()
        assert patch.calls == len(norms(model16)), repr(patch)
        if policy == "mixed_bfloat16":  # a model built under the patch: the same outputs
            built_after = backbone(family, policy)
            np.testing.assert_array_equal(jax.jit(lambda: built_after(x))(), ours)
    assert ours.dtype == theirs.dtype == jnp.bfloat16
    err_ours, err_theirs = rel_l2(ours, expected), rel_l2(theirs, expected)
    client_record(
        library="keras", family=f"{family}, {policy}", bf16_ours=err_ours, bf16_theirs=err_theirs
    )
    assert err_ours <= 1.1 * err_theirs + 1e-3, (err_ours, err_theirs)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "bfloat16"])
def test_a_gpu_backward_writes_each_qk_norms_half_dy(policy):
    """On a GPU the cotangent of each norm with 16-bit rows of at most 256 features (a
    QK-norm's; here every norm's: hidden 32) passes one barrier before the norm's backward
    (``_keras._own_gradient_sum``); a TPU program holds none, nor a float32 model. Forward
    mode goes through it: the jvp is the gradient's inner product with the tangent."""
    model = backbone("qwen3", policy)
    x = inputs("qwen3")
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def loss(trainable):
        out, _ = model.stateless_call(trainable, non_trainable, x)
        return jnp.sum(out.astype(F32))

    def barriers(platform):
        traced = jax.jit(jax.grad(loss)).trace(trainable)
        return (
            traced.lower(lowering_platforms=(platform,))
            .as_text()
            .count("stablehlo.optimization_barrier")
        )

    assert (barriers("cuda"), barriers("tpu")) == (0, 0)  # unpatched
    with integrations.patch_keras() as patch:
        half = policy != "float32"
        assert (barriers("cuda"), barriers("tpu")) == (len(norms(model)) if half else 0, 0)
        assert patch.calls > 0, repr(patch)
        tangent = jax.tree.map(lambda a: jnp.full_like(a, 0.5), trainable)
        _, jvp = jax.jit(lambda p, t: jax.jvp(loss, (p,), (t,)))(trainable, tangent)
        grads = jax.jit(jax.grad(loss))(trainable)
    inner = sum(jnp.vdot(g.astype(F32), t.astype(F32)) for g, t in zip(grads, tangent, strict=True))
    # bfloat16: the forward and the reverse pass each round their own way
    np.testing.assert_allclose(jvp, inner, rtol=1e-2 if half else 1e-5)


def _one_tpu_v5e_chip():
    """The deviceless TPU v5e target and ``struct(shape, dtype)``: an abstract array on
    one of its chips, replicated (what the two TPU compiles below take)."""
    from jax.sharding import PartitionSpec as P

    from rmsnorm_jax import aot

    target = aot_target("tpu-v5e")
    mesh = jax.sharding.Mesh(np.array(target.devices[:1], dtype=object), ("d",))
    return target, lambda shape, dtype: aot.struct(shape, dtype, mesh, P())


@pytest.mark.parametrize("batch", [1, 2])
def test_a_tpu_qwen3_attention_gradient_is_estimated_no_slower_than_keras(batch):
    """XLA:TPU's estimate of the gradient of one KerasHub ``Qwen3Attention`` at Qwen3
    0.6B's sizes (hidden 1,024, 16 query heads of 128, 8 key-value heads, bfloat16, 512
    tokens) with the patch is at most Keras's own. A batch of one is the case that was
    not: before the cores dropped its axis (``passes.without_unit_axes``), XLA:TPU
    recomputed the query's RoPE backward in a ``dx`` pass of its own, 4.4 % over Keras's
    estimate."""
    from rmsnorm_jax import aot

    target, struct = _one_tpu_v5e_chip()
    hidden, tokens = 1024, 512

    def estimate():
        layer = keras_hub.src.models.qwen3.qwen3_attention.Qwen3Attention(
            16, 8, 128, dtype="bfloat16", layer_norm_epsilon=1e-6
        )
        layer.build((batch, tokens, hidden))
        trainable = [v.value for v in layer.trainable_variables]

        def loss(trainable, x, ct):
            return jnp.sum((layer.stateless_call(trainable, [], x)[0] * ct).astype(F32))

        x = struct((batch, tokens, hidden), jnp.bfloat16)
        compiled = target.compile(
            jax.jit(jax.grad(loss, (0, 1))), [struct(a.shape, a.dtype) for a in trainable], x, x
        )
        return aot.estimate(compiled, target)

    theirs = estimate()
    with integrations.patch_keras() as patch:
        ours = estimate()
        assert patch.calls == 2, repr(patch)  # the query's and the key's norms
    assert ours <= theirs, (ours, theirs)


def test_a_tpu_qwen3_step_at_a_batch_of_one_needs_no_more_temp_than_keras():
    """A KerasHub Qwen3 train step at Qwen3 0.6B's sizes (4 of its 28 layers, its 151,936
    vocabulary, ``mixed_bfloat16``, 1 x 2,048 tokens) compiled for TPU v5e needs at most
    Keras's temp memory with the patch. When the cores dropped a hidden norm's batch axis
    of one too (``[1, T, D]``, c92aea3 to 10d6d5d) it needed 3,051.0 MiB against 3,021.0
    (28 layers: 10,797.3 against 10,386.0); they now drop it only where the rows keep two
    axes (``passes.without_unit_axes``)."""
    target, struct = _one_tpu_v5e_chip()
    sizes = dict(vocabulary_size=151936, num_layers=4, num_query_heads=16,
                 num_key_value_heads=8, hidden_dim=1024, intermediate_dim=3072, head_dim=128,
                 rope_max_wavelength=1000000, layer_norm_epsilon=1e-6)  # fmt: skip

    def temp():
        backbone = keras_hub.models.Qwen3Backbone(**sizes, dtype="mixed_bfloat16")
        model = keras_hub.models.Qwen3CausalLM(backbone=backbone, preprocessor=None)
        frozen = [v.value for v in model.non_trainable_variables]

        def loss(params, tokens):
            x = {"token_ids": tokens, "padding_mask": jnp.ones_like(tokens, bool)}
            out = model.stateless_call(params, frozen, x)[0][:, :-1].astype(F32)
            return -jnp.take_along_axis(jax.nn.log_softmax(out), tokens[:, 1:, None], -1).mean()

        params = [struct(v.value.shape, v.value.dtype) for v in model.trainable_variables]
        tokens = struct((1, 2048), jnp.int32)
        compiled = target.compile(jax.jit(jax.value_and_grad(loss)), params, tokens)
        return compiled.memory_analysis().temp_size_in_bytes

    theirs = temp()
    with integrations.patch_keras() as patch:
        ours = temp()
        assert patch.calls > 0, repr(patch)
    assert ours <= theirs, (ours / 2**20, theirs / 2**20)


# ---------------------------------------------------------------- checks and refusals


def test_patch_keras_targets_families_and_undo():
    own = own_calls()
    with integrations.patch_keras() as patch:
        assert patch.targets == tuple(call_of(cls) for cls in norm_classes())
        assert len(patch.targets) == 18
        assert "reached nothing" in repr(patch)
        integrations.patch_keras()  # again: replaces, never wraps
        llama = M.LlamaBackbone.__module__.replace("llama_backbone", "llama_layernorm")
        cls = sys.modules[llama].LlamaLayerNorm
        assert cls.__dict__["call"].__rmsnorm_jax_original__ is own[cls]
    assert own_calls() == own
    with integrations.patch_keras(families=("llama", "qwen3")) as patch:
        changed = {c for c in own if c.__dict__["call"] is not own[c]}
        assert {c.__name__ for c in changed} == {"LlamaLayerNorm", "Qwen3LayerNorm"}
        gemma = backbone("gemma")
        assert patch.calls == 0, repr(patch)  # gemma keeps Keras's norm, built and run
        jax.jit(lambda: gemma(inputs("gemma")))()
        assert patch.calls == 0, repr(patch)
    assert own_calls() == own
    with pytest.raises(ValueError, match=r"families=\('gemma5',\) names 'gemma5'.*'gemma4'"):
        integrations.patch_keras(families="gemma5")
    integrations.patch_keras()
    integrations.unpatch_keras()
    assert own_calls() == own


def _without_offset(norm, original, implementation, hit):
    """A hand-written swap of Gemma's norm without ``scale_offset=1.0``."""
    from rmsnorm_jax import rms_norm

    def call(self, x):
        return rms_norm(x, keras.ops.convert_to_tensor(self.scale), self.epsilon)

    return call


def _float32_scale(norm, original, implementation, hit):
    """A swap that reads the float32 variable where Keras's call sees the autocast one."""
    from rmsnorm_jax import rms_norm

    def call(self, x):
        return rms_norm(x, self.scale._value, self.epsilon, dtype=self.compute_dtype)

    return call


def _compute_dtype(norm, original, implementation, hit):
    """A swap of Qwen3's norm that returns the compute dtype, not ``x``'s."""
    from rmsnorm_jax import rms_norm

    def call(self, x):
        scale = keras.ops.convert_to_tensor(self.scale)
        return rms_norm(x, scale, self.epsilon, dtype=self.compute_dtype)

    return call


@pytest.mark.parametrize(
    ("family", "make", "message"),
    [
        ("gemma", _without_offset, r"under float32, float32 outputs differ by 0\.\d+ relative"),
        ("llama", _float32_scale, r"under mixed_bfloat16, bfloat16 outputs differ in [1-9]\d\.\d%"),
        ("qwen3", _compute_dtype, r"autocast=False, ours gives .*bfloat16.* where the library "),
    ],
)
def test_a_swap_that_changes_outputs_is_refused(monkeypatch, family, make, message):
    own = own_calls()
    monkeypatch.setattr(_keras, "_hub_call", make)
    with pytest.raises(
        RuntimeError, match=rf"refused {_keras.FAMILIES[family][0].path}: on the probe"
    ) as err:
        integrations.patch_keras(families=family)
    assert err.match(message)
    assert own_calls() == own  # nothing was patched


def test_a_class_of_another_shape_is_refused(monkeypatch):
    own = own_calls()
    llama = sys.modules[_keras.FAMILIES["llama"][0].module].LlamaLayerNorm
    build = llama.build

    def zeros_build(self, input_shape):
        build(self, input_shape)
        self.scale.assign(np.zeros(self.scale.shape, "float32"))

    monkeypatch.setattr(llama, "build", zeros_build)
    with pytest.raises(
        RuntimeError,
        match=r"LlamaLayerNorm: its build makes the weights .*'scale', \(64,\), True, \{0\.0\}",
    ):
        integrations.patch_keras()
    monkeypatch.setattr(llama, "build", build)

    def call(self, x, mask=None):
        return x

    monkeypatch.setattr(llama, "call", call)
    with pytest.raises(
        RuntimeError,
        match=r"its call is call\(self, x, mask\), where patch_keras\(\) knows call\(self, x\)",
    ):
        integrations.patch_keras()
    monkeypatch.undo()
    assert own_calls() == own


def test_an_unknown_version_is_refused_unless_allowed(monkeypatch):
    monkeypatch.setattr(keras_hub, "__version__", "0.33.0")
    with pytest.raises(
        RuntimeError,
        match=r"knows keras 3\.15 and keras-hub 0\.32, not keras-hub 0\.33\.0: pip install",
    ):
        integrations.patch_keras()
    with integrations.patch_keras(allow_unknown_versions=True, families="llama") as patch:
        assert len(patch.targets) == 1


def test_an_unknown_norm_class_is_named_and_left_alone(monkeypatch):
    module = types.ModuleType("keras_hub.src.models.newmodel.newmodel_layers")

    class NewModelRMSNorm(keras.layers.Layer):
        def call(self, x):
            return x

    NewModelRMSNorm.__module__ = module.__name__
    module.NewModelRMSNorm = NewModelRMSNorm
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with pytest.warns(
        UserWarning,
        match=r"does not know keras_hub\.src\.models\.newmodel\.newmodel_layers\.NewModelRMSNorm",
    ):
        patch = integrations.patch_keras(families="llama")
    assert (
        "call" not in NewModelRMSNorm.__dict__
        or NewModelRMSNorm.__dict__["call"].__name__ == "call"
    )
    patch.undo()


@pytest.mark.parametrize(
    ("backend", "error", "message"),
    [
        ("numpy", "RuntimeError", "runs on its 'numpy' backend: set KERAS_BACKEND=jax"),
        ("tensorflow", "ImportError", "its backend needs tensorflow.*set KERAS_BACKEND=jax"),
    ],
)
def test_another_keras_backend_is_refused_with_the_fix(backend, error, message):
    code = (
        "import re, sys\n"
        "from rmsnorm_jax.integrations import patch_keras\n"
        "try:\n    patch_keras()\n"
        f"except {error} as err:\n"
        f"    sys.exit(0 if re.search({message!r}, str(err)) else str(err))\n"
        "sys.exit('patched')\n"
    )
    env = dict(os.environ, KERAS_BACKEND=backend, JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_without_keras_hub_keras_core_alone(monkeypatch):
    """KerasHub is optional: without it, ``keras.layers.RMSNormalization`` alone."""
    monkeypatch.setitem(sys.modules, "keras_hub", None)
    with integrations.patch_keras() as patch:
        assert patch.targets == (call_of(keras.layers.RMSNormalization),)
    with pytest.raises(ValueError, match=r"names 'gemma', which this installation does not"):
        integrations.patch_keras(families="gemma")
