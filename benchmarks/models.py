"""The models whose train step is measured, each with a pluggable ``norm(x, scale) -> y``:
a pre-norm stack, a Gemma-3-style decoder and a MaxText-shaped Llama2-style decoder (written
from the public architectures; float32 parameters, bfloat16 activations)."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import optax
from jax import lax

import rmsnorm_jax

from .peers import EPS

# ---------------------------------------------------------------- the pre-norm stack

MLPS = ("relu", "gelu", "swiglu")


def _mlp(y, p, mlp: str):
    if mlp == "swiglu":
        return (jax.nn.silu(y @ p["w1"]) * (y @ p["w3"])) @ p["w2"]
    return {"relu": jax.nn.relu, "gelu": jax.nn.gelu}[mlp](y @ p["w1"]) @ p["w2"]


def prenorm_stack_train_step(
    norm, layers=8, mlp="swiglu", unroll=False, remat_policy=None, implementation="auto"
):
    """``(train_step(params, h) -> params, params_shapes(d, dtype))``: SGD on ``layers``
    pre-norm blocks (``h + norm1(h) @ wv @ wo``, ``h + mlp(norm2(h))``; relu and gelu 4x
    hidden, SwiGLU 8/3x) under ``lax.scan``, a final norm, a mean-square loss, parameters in
    h's dtype. ``norm=None`` fuses each residual add into the next norm (``add_rms_norm``
    on ``implementation``'s path); ``unroll``: a cost model counts a loop body once;
    ``remat_policy`` checkpoints each layer. ``train_step.objective`` is the loss."""
    fused = functools.partial(rmsnorm_jax.add_rms_norm, implementation=implementation)
    if mlp not in MLPS:
        raise ValueError(f"mlp={mlp!r}: expected one of {MLPS}")

    def remat(layer):
        return layer if remat_policy is None else jax.checkpoint(layer, policy=remat_policy)

    def loss(params, h):
        def layer(h, p):
            h = h + (norm(h, p["scale1"]) @ p["wv"]) @ p["wo"]
            return h + _mlp(norm(h, p["scale2"]), p, mlp), None

        h, _ = lax.scan(remat(layer), h, params["layers"], unroll=unroll)
        return jnp.mean(jnp.square(norm(h, params["final_scale"]).astype(jnp.float32)))

    def fused_loss(params, h):
        def layer(carry, p):  # the stream and the block's output not yet added
            h, delta = carry
            y, h = fused(delta, h, p["scale1"], EPS)
            y, h = fused((y @ p["wv"]) @ p["wo"], h, p["scale2"], EPS)
            return (h, _mlp(y, p, mlp)), None

        init = (h, jnp.zeros_like(h))
        (h, delta), _ = lax.scan(remat(layer), init, params["layers"], unroll=unroll)
        y, _ = fused(delta, h, params["final_scale"], EPS)
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    objective = fused_loss if norm is None else loss

    def train_step(params, h):
        grads = jax.grad(objective)(params, h)
        return jax.tree.map(lambda p, g: p - 1e-3 * g.astype(p.dtype), params, grads)

    train_step.objective = objective

    def params_shapes(d: int, dtype) -> dict:
        hidden = 4 * d if mlp != "swiglu" else -(-8 * d // 3 // 256) * 256
        shapes = dict(scale1=(d,), scale2=(d,), wv=(d, d), wo=(d, d), w1=(d, hidden))
        shapes |= dict(w2=(hidden, d)) | ({"w3": (d, hidden)} if mlp == "swiglu" else {})
        per_layer = {k: jax.ShapeDtypeStruct((layers, *s), dtype) for k, s in shapes.items()}
        return {"layers": per_layer, "final_scale": jax.ShapeDtypeStruct((d,), dtype)}

    return train_step, params_shapes


def step_inputs(params_shapes, d: int, tokens: int, dtype):
    """Parameters (weights ~ N(0, 1/fan_in), scales of ones) and the input stream h."""
    leaves, treedef = jax.tree.flatten(params_shapes(d, dtype))
    keys = jax.random.split(jax.random.key(1), len(leaves) + 1)
    values = [
        (jax.random.normal(k, s.shape) / math.sqrt(s.shape[-2])).astype(s.dtype)
        if len(s.shape) == 3
        else jnp.ones(s.shape, s.dtype)
        for k, s in zip(keys[1:], leaves, strict=True)
    ]
    h = jax.random.normal(keys[0], (tokens, d)).astype(dtype)
    return jax.tree.unflatten(treedef, values), h


# ---------------------------------------------------------------- shared by the decoders


def _rope(x, positions, base):
    """Rotary position embedding on the last axis of ``x`` (batch, seq, heads, head_dim)."""
    half = x.shape[-1] // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[:, :, None, None].astype(jnp.float32) * freq
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def _attend(logits, allowed, v, dt, out: str):
    """The float32 softmax of ``logits`` where ``allowed``, applied to v (einsum ``out``)."""
    probs = jax.nn.softmax(jnp.where(allowed, logits, -1e30), axis=-1).astype(dt)
    return jnp.einsum(out, probs, v)


def _init(shapes: dict, key, norm_init, fan_in) -> dict:
    """Norm scales from ``norm_init(key, shape)``, the rest ~ N(0, 1/fan_in(name, shape))."""
    out = {}
    for (name, shape), k in zip(shapes.items(), jax.random.split(key, len(shapes)), strict=True):
        if name.endswith("norm"):
            out[name] = norm_init(k, shape)
        else:
            out[name] = jax.random.normal(k, shape) / math.sqrt(fan_in(name, shape))
    return out


def _xent(logits, targets):
    """Mean next-token cross-entropy, the log-sum-exp in float32 (on bfloat16 logits: a
    float32 log-softmax would keep a float32 copy of them for the backward)."""
    lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(lse - picked.astype(jnp.float32))


def _stack(blocks: list, scan: bool):
    return jax.tree.map(lambda *a: jnp.stack(a), *blocks) if scan else blocks


def _train_step(loss, opt: optax.GradientTransformation):
    """``step(params, opt_state, tokens, targets) -> (params, opt_state, loss)``."""

    def step(params, opt_state, tokens, targets):
        value, grads = jax.value_and_grad(lambda p: loss(p, tokens, targets))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step


def _shapes(init, opt, batch: int, seq: int):
    """``(params, opt_state, tokens, targets)`` as ``ShapeDtypeStruct``s."""
    params = jax.eval_shape(lambda: init(jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return params, jax.eval_shape(opt.init, params), tokens, tokens


# ---------------------------------------------------------------- the Gemma-3-style decoder


@dataclasses.dataclass(frozen=True)
class Config:
    """The shape of the model. The defaults are Gemma 3 270M's."""

    vocab: int = 262_144
    d: int = 640
    layers: int = 18
    heads: int = 4
    kv_heads: int = 1
    head_dim: int = 256
    hidden: int = 2048
    window: int | None = 512  # sliding window of the local layers; None: all global
    global_every: int = 6  # every 6th layer is global
    dtype: jnp.dtype = jnp.bfloat16  # activations; parameters are float32

    def is_global(self, layer: int) -> bool:
        return self.window is None or (layer + 1) % self.global_every == 0


GEMMA3_270M = Config()
SMALL = Config(vocab=512, d=64, layers=2, heads=4, kv_heads=1, head_dim=16, hidden=128, window=4)


def init_params(cfg: Config, key, scan: bool, norm_scale_std: float = 0.0) -> dict:
    """Float32 parameters; norm scales zero (Gemma's) or ~ N(0, ``norm_scale_std``) (tests:
    a zero scale hides scale errors); ``scan``: the blocks stacked on a leading axis."""
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    shapes = dict(
        pre_attn_norm=(cfg.d,), q=(cfg.d, q), kv=(2, cfg.d, kv), q_norm=(cfg.head_dim,),
        k_norm=(cfg.head_dim,), out=(q, cfg.d), post_attn_norm=(cfg.d,), pre_mlp_norm=(cfg.d,),
        gate_up=(2, cfg.d, cfg.hidden), down=(cfg.hidden, cfg.d), post_mlp_norm=(cfg.d,),
    )  # fmt: skip
    norm_init = lambda k, shape: norm_scale_std * jax.random.normal(k, shape)
    k_embed, k_final, *k_blocks = jax.random.split(key, cfg.layers + 2)
    blocks = [_init(shapes, k, norm_init, lambda name, s: s[-2]) for k in k_blocks]
    return {
        "embed": jax.random.normal(k_embed, (cfg.vocab, cfg.d)) / math.sqrt(cfg.d),
        "blocks": _stack(blocks, scan),
        "final_norm": norm_init(k_final, (cfg.d,)),
    }


def _attention(cfg: Config, norm, p, x, is_global):
    """Grouped-query attention with a QK-norm; ``is_global`` a bool or a traced bool."""
    dt, (batch, seq, _) = cfg.dtype, x.shape
    q = (x @ p["q"].astype(dt)).reshape(batch, seq, cfg.heads, cfg.head_dim)
    k, v = (x @ p["kv"][i].astype(dt) for i in range(2))
    k = k.reshape(batch, seq, cfg.kv_heads, cfg.head_dim)
    v = v.reshape(batch, seq, cfg.kv_heads, cfg.head_dim)
    q, k = norm(q, p["q_norm"]), norm(k, p["k_norm"])
    positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
    base = jnp.where(is_global, 1_000_000.0, 10_000.0)
    q, k = _rope(q, positions, base), _rope(k, positions, base)
    q = q * jnp.asarray(cfg.head_dim**-0.5, dt)
    q = q.reshape(batch, seq, cfg.kv_heads, cfg.heads // cfg.kv_heads, cfg.head_dim)
    logits = jnp.einsum("btkgh,bskh->bkgts", q, k).astype(jnp.float32)
    i, j = jnp.arange(seq)[:, None], jnp.arange(seq)[None, :]
    allowed = j <= i
    if cfg.window is not None:
        allowed = allowed & (is_global | (i - j < cfg.window))
    out = _attend(logits, allowed, v, dt, "bkgts,bskh->btkgh").reshape(batch, seq, -1)
    return out @ p["out"].astype(dt)


def _block(cfg: Config, norm, p, x, is_global):
    dt = cfg.dtype
    attn = _attention(cfg, norm, p, norm(x, p["pre_attn_norm"]), is_global)
    x = x + norm(attn, p["post_attn_norm"])
    y = norm(x, p["pre_mlp_norm"])
    gate, up = (y @ p["gate_up"][i].astype(dt) for i in range(2))
    return x + norm((jax.nn.gelu(gate) * up) @ p["down"].astype(dt), p["post_mlp_norm"])


def logits_fn(cfg: Config, norm, params, tokens, scan: bool):
    """Logits (batch, seq, vocab) in the activation dtype."""
    embed = params["embed"]
    x = (embed[tokens] * math.sqrt(cfg.d)).astype(cfg.dtype)
    if scan:
        flags = jnp.array([cfg.is_global(i) for i in range(cfg.layers)])
        body = lambda x, pf: (_block(cfg, norm, pf[0], x, pf[1]), None)
        x, _ = lax.scan(body, x, (params["blocks"], flags))
    else:
        for i, p in enumerate(params["blocks"]):
            x = _block(cfg, norm, p, x, cfg.is_global(i))
    return norm(x, params["final_norm"]) @ embed.astype(cfg.dtype).T


def loss_fn(cfg: Config, norm, params, tokens, targets, scan: bool):
    return _xent(logits_fn(cfg, norm, params, tokens, scan), targets)


def optimizer() -> optax.GradientTransformation:
    return optax.adamw(1e-4, weight_decay=0.01)


def gemma_train_step(cfg: Config, norm, scan: bool):
    """``step(params, opt_state, tokens, targets) -> (params, opt_state, loss)``; ``scan``
    runs the stacked blocks under ``lax.scan``, else unrolled in Python."""
    return _train_step(lambda p, t, y: loss_fn(cfg, norm, p, t, y, scan), optimizer())


def gemma_step_shapes(cfg: Config, scan: bool, batch: int, seq: int):
    return _shapes(lambda key: init_params(cfg, key, scan), optimizer(), batch, seq)


def gemma_inputs(cfg: Config, scan: bool, batch: int, seq: int):
    """``(params, opt_state, tokens, targets)``: random tokens, each next one the target."""
    tokens = jax.random.randint(jax.random.key(0), (batch, seq + 1), 0, cfg.vocab)
    params = init_params(cfg, jax.random.key(1), scan)
    return params, optimizer().init(params), tokens[:, :-1], tokens[:, 1:]


# ---------------------------------------------------------------- the MaxText-shaped decoder


@dataclasses.dataclass(frozen=True)
class MaxTextConfig:
    """A Llama2-style decoder as MaxText builds it (``decoder_block: llama2``). The defaults,
    the tables' size, are 4 layers of ``llama2-7b``'s shape scaled to compile in minutes."""

    vocab: int = 32_000
    d: int = 1024
    layers: int = 4
    heads: int = 8
    head_dim: int = 128
    hidden: int = 3584
    eps: float = 1e-5  # MaxText's normalization_layer_epsilon for llama2
    rope_base: float = 10_000.0
    dtype: jnp.dtype = jnp.bfloat16  # activations; parameters are float32


MAXTEXT_TABLES = MaxTextConfig()
MAXTEXT_QUICK = MaxTextConfig(vocab=1024, d=256, layers=2, heads=4, head_dim=64, hidden=512)
REMAT_POLICIES = ("full", "minimal", "none")


def remat_policy(name: str):
    """MaxText's ``remat_policy`` as ``(checkpointed, policy)``: ``full`` saves nothing,
    ``minimal`` the matmuls without batch dimensions, ``none`` does not checkpoint."""
    policies = {"full": (True, None), "none": (False, None)}
    policies["minimal"] = (True, jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims)
    if name not in policies:
        raise ValueError(f"remat_policy={name!r}: expected one of {REMAT_POLICIES}")
    return policies[name]


def maxtext_init_params(cfg: MaxTextConfig, key, scan: bool, norm_scale_std: float = 0.0):
    """Float32 parameters: kernels ~ N(0, 1/fan_in) (MaxText's DenseGeneral layout), norm
    scales ones plus ``norm_scale_std`` x N(0, 1) (tests); ``scan``: layers stacked."""
    qkv = (cfg.d, cfg.heads, cfg.head_dim)
    shapes = dict(
        pre_self_attention_layer_norm=(cfg.d,), query=qkv, key=qkv, value=qkv,
        out=(cfg.heads, cfg.head_dim, cfg.d), post_self_attention_layer_norm=(cfg.d,),
        wi_0=(cfg.d, cfg.hidden), wi_1=(cfg.d, cfg.hidden), wo=(cfg.hidden, cfg.d),
    )  # fmt: skip
    norm_init = lambda k, shape: 1 + norm_scale_std * jax.random.normal(k, shape)
    fan_in = lambda name, shape: cfg.heads * cfg.head_dim if name == "out" else shape[0]
    k_embed, k_logits, k_final, *k_layers = jax.random.split(key, cfg.layers + 3)
    return {
        "token_embedder": jax.random.normal(k_embed, (cfg.vocab, cfg.d)),
        "layers": _stack([_init(shapes, k, norm_init, fan_in) for k in k_layers], scan),
        "decoder_norm": norm_init(k_final, (cfg.d,)),
        "logits_dense": jax.random.normal(k_logits, (cfg.d, cfg.vocab)) / math.sqrt(cfg.d),
    }


def _maxtext_attention(cfg: MaxTextConfig, p, x):
    """Causal multi-head attention with RoPE, the query scaled by ``1/sqrt(head_dim)``."""
    dt, (batch, seq, _) = cfg.dtype, x.shape
    q, k, v = (jnp.einsum("btd,dhk->bthk", x, p[n].astype(dt)) for n in ("query", "key", "value"))
    positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
    q, k = _rope(q, positions, cfg.rope_base), _rope(k, positions, cfg.rope_base)
    q = q * jnp.asarray(cfg.head_dim**-0.5, dt)
    logits = jnp.einsum("bthk,bshk->bhts", q, k).astype(jnp.float32)
    causal = jnp.arange(seq)[:, None] >= jnp.arange(seq)[None, :]
    out = _attend(logits, causal, v, dt, "bhts,bshk->bthk")
    return jnp.einsum("bthk,hkd->btd", out, p["out"].astype(dt))


def _maxtext_layer(cfg: MaxTextConfig, norm, p, x):
    """Pre-norm attention and pre-norm SwiGLU MLP, each added to the residual stream."""
    dt = cfg.dtype
    x = x + _maxtext_attention(cfg, p, norm(x, p["pre_self_attention_layer_norm"]))
    y = norm(x, p["post_self_attention_layer_norm"])
    gate, up = (y @ p[n].astype(dt) for n in ("wi_0", "wi_1"))
    return x + (jax.nn.silu(gate) * up) @ p["wo"].astype(dt)


def maxtext_logits(cfg: MaxTextConfig, norm, params, tokens, scan: bool, remat: str = "full"):
    """Float32 logits (batch, seq, vocab); each layer under ``jax.checkpoint`` with the
    ``remat`` policy, scanned over the stacked layers or a Python loop over the list."""
    checkpointed, policy = remat_policy(remat)
    layer = lambda x, p: (_maxtext_layer(cfg, norm, p, x), None)
    if checkpointed:
        layer = jax.checkpoint(layer, policy=policy, prevent_cse=not scan)
    x = params["token_embedder"][tokens].astype(cfg.dtype)
    if scan:
        x, _ = lax.scan(layer, x, params["layers"])
    else:
        for p in params["layers"]:
            x, _ = layer(x, p)
    x = norm(x, params["decoder_norm"])
    return (x @ params["logits_dense"].astype(cfg.dtype)).astype(jnp.float32)


def maxtext_loss(cfg: MaxTextConfig, norm, params, tokens, targets, scan: bool, remat: str):
    return _xent(maxtext_logits(cfg, norm, params, tokens, scan, remat), targets)


def maxtext_optimizer() -> optax.GradientTransformation:
    """MaxText's default AdamW (b1 0.9, b2 0.95, eps 1e-8, weight decay 0.1)."""
    return optax.adamw(1e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)


def maxtext_train_step(cfg: MaxTextConfig, norm, scan: bool, remat: str = "full"):
    loss = lambda p, t, y: maxtext_loss(cfg, norm, p, t, y, scan, remat)
    return _train_step(loss, maxtext_optimizer())


def maxtext_step_shapes(cfg: MaxTextConfig, scan: bool, batch: int, seq: int):
    return _shapes(lambda key: maxtext_init_params(cfg, key, scan), maxtext_optimizer(), batch, seq)
