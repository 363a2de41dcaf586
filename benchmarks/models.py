"""The models whose train step the benchmarks measure, each with a pluggable norm.

- :func:`prenorm_stack_train_step`: a uniform stack of pre-norm residual blocks (two norms
  each, a token-wise linear mixer, a relu, gelu or SwiGLU MLP) under ``lax.scan``; SGD.
  Only the norm differs between the programs compared. :func:`step_inputs` makes its
  arrays.
- A Gemma-3-style decoder (:class:`Config`, :data:`GEMMA3_270M`, :data:`SMALL`,
  :func:`gemma_train_step`), written here from the public architecture (flax's
  ``examples/gemma`` is the reference; nothing is downloaded): token embeddings tied with
  the output layer and scaled by ``sqrt(d)``; per block a pre- and a post-norm around
  attention and around the MLP, all ``(1 + scale)`` norms with zero-initialised scales;
  grouped-query attention with RoPE and a QK-norm over the head dimension; a gelu-gated MLP;
  local (sliding-window) and global layers mixed five to one; a final norm. Parameters are
  float32, activations bfloat16. Its norm is ``norm(x, scale) -> y`` with ``y`` in ``x``'s
  dtype and ``scale`` the stored zero-centred parameter (``peers.GEMMA_NORMS``).
  :func:`gemma_train_step`: cross-entropy loss, gradient and an AdamW update (optax);
  ``scan=False`` unrolls the blocks in Python (as flax's example does), ``scan=True`` stacks
  their parameters and runs them under ``lax.scan``. :func:`gemma_inputs` makes its arrays.
- A MaxText-shaped Llama2-style decoder (:class:`MaxTextConfig`, :func:`maxtext_train_step`),
  written from MaxText's public architecture (``decoder_block: llama2``): a token embedding
  and an untied output projection; per layer a pre-norm around causal multi-head attention
  with RoPE and around a SwiGLU MLP, each added to the residual stream; a final norm;
  ones-initialised ``x_hat * scale`` norms (``peers.MAXTEXT_NORMS``). Each layer runs
  under ``jax.checkpoint`` with MaxText's remat policy (``full``, ``minimal``; ``none``
  leaves it out), the layers under ``lax.scan`` or unrolled. Float32 parameters, bfloat16
  activations, float32 logits, AdamW with MaxText's defaults.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax

import rmsnorm_jax

from .peers import EPS

# ---------------------------------------------------------------- the pre-norm stack

MLPS = ("relu", "gelu", "swiglu")


def _mlp_hidden(d: int, mlp: str) -> int:
    # 4x for relu and gelu; SwiGLU as in LLaMA: 2/3 of 4x, rounded up to 256.
    return 4 * d if mlp != "swiglu" else -(-8 * d // 3 // 256) * 256


def _mlp(y, p, mlp: str):
    if mlp == "relu":
        return jax.nn.relu(y @ p["w1"]) @ p["w2"]
    if mlp == "gelu":
        return jax.nn.gelu(y @ p["w1"]) @ p["w2"]
    if mlp == "swiglu":
        return (jax.nn.silu(y @ p["w1"]) * (y @ p["w3"])) @ p["w2"]
    raise ValueError(f"mlp={mlp!r}: expected one of {MLPS}")


def prenorm_stack_train_step(
    norm: Callable | None,
    layers: int = 8,
    mlp: str = "swiglu",
    unroll: bool = False,
    remat_policy: Callable | None = None,
):
    """An SGD step of a stack of pre-norm residual blocks, ``lax.scan`` over the layers.

    Each block has a Transformer layer's two norms: a token-wise linear mixer (standing
    in for attention, ``h + norm1(h) @ wv @ wo``) and an MLP (``mlp``: ``"relu"`` or
    ``"gelu"`` (tanh form) with 4x hidden units, or LLaMA's ``"swiglu"``,
    ``(silu(y @ w1) * (y @ w3)) @ w2`` with 8/3x); then a final norm and a mean-square
    loss. The parameters and activations share the dtype of ``h``. Only the norm
    differs between the programs compared, so their temporary memory shows what each
    norm keeps for the backward pass inside a real train step (under ``jit``, after
    XLA's own rematerialisation and buffer reuse).

    ``norm=None``: every residual add fused into the next norm with ``add_rms_norm``.
    ``unroll``: unroll the scan, so that a compiler's cost estimate (which counts a loop
    body once) covers every layer.
    ``remat_policy``: checkpoint each layer, ``jax.checkpoint(layer, policy=remat_policy)``;
    with ``jax.checkpoint_policies.save_only_these_names("rms_norm_stat")`` the backward
    pass keeps the scan's carry and each norm's float32 statistic per row, and recomputes
    the rest of the layer's forward (below the ``x * scale`` floor, at a price in time).

    Returns ``(train_step, params_shapes)``: ``train_step(params, h) -> params`` and
    ``params_shapes(d, dtype)``, the parameters' ``ShapeDtypeStruct``s.
    """
    if mlp not in MLPS:
        raise ValueError(f"mlp={mlp!r}: expected one of {MLPS}")

    def remat(layer):
        return layer if remat_policy is None else jax.checkpoint(layer, policy=remat_policy)

    def loss(params, h):
        def layer(h, p):
            h = h + (norm(h, p["scale1"]) @ p["wv"]) @ p["wo"]
            h = h + _mlp(norm(h, p["scale2"]), p, mlp)
            return h, None

        h, _ = jax.lax.scan(remat(layer), h, params["layers"], unroll=unroll)
        return jnp.mean(jnp.square(norm(h, params["final_scale"]).astype(jnp.float32)))

    def fused_loss(params, h):
        # The same network with each residual add fused into the next norm
        # (add_rms_norm): the scan carries the stream and the block's pending output.
        def layer(carry, p):
            h, delta = carry
            y, h = rmsnorm_jax.add_rms_norm(delta, h, p["scale1"], EPS)
            y, h = rmsnorm_jax.add_rms_norm((y @ p["wv"]) @ p["wo"], h, p["scale2"], EPS)
            return (h, _mlp(y, p, mlp)), None

        (h, delta), _ = jax.lax.scan(
            remat(layer), (h, jnp.zeros_like(h)), params["layers"], unroll=unroll
        )
        y, _ = rmsnorm_jax.add_rms_norm(delta, h, params["final_scale"], EPS)
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    objective = fused_loss if norm is None else loss

    def train_step(params, h):
        grads = jax.grad(objective)(params, h)
        return jax.tree.map(lambda p, g: p - 1e-3 * g.astype(p.dtype), params, grads)

    train_step.objective = objective  # the loss, for what its backward keeps (tests)

    def params_shapes(d: int, dtype) -> dict:
        s = jax.ShapeDtypeStruct
        hidden = _mlp_hidden(d, mlp)
        per_layer = {
            "scale1": s((layers, d), dtype),
            "scale2": s((layers, d), dtype),
            "wv": s((layers, d, d), dtype),
            "wo": s((layers, d, d), dtype),
            "w1": s((layers, d, hidden), dtype),
            "w2": s((layers, hidden, d), dtype),
        }
        if mlp == "swiglu":
            per_layer["w3"] = s((layers, d, hidden), dtype)
        return {"layers": per_layer, "final_scale": s((d,), dtype)}

    return train_step, params_shapes


def step_inputs(params_shapes, d: int, tokens: int, dtype):
    """Parameters (weights ~ N(0, 1/fan_in), scales of ones) and the input stream h."""
    leaves, treedef = jax.tree.flatten(params_shapes(d, dtype))
    keys = jax.random.split(jax.random.key(1), len(leaves) + 1)
    values = [
        (jax.random.normal(k, s.shape, jnp.float32) / math.sqrt(s.shape[-2])).astype(s.dtype)
        if len(s.shape) == 3
        else jnp.ones(s.shape, s.dtype)  # the scales: (layers, d) and (d,)
        for k, s in zip(keys[1:], leaves, strict=True)
    ]
    h = jax.random.normal(keys[0], (tokens, d), jnp.float32).astype(dtype)
    return jax.tree.unflatten(treedef, values), h


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
    global_every: int = 6  # every 6th layer is global (five local to one global)
    dtype: jnp.dtype = jnp.bfloat16  # activations; parameters are float32

    def is_global(self, layer: int) -> bool:
        return self.window is None or (layer + 1) % self.global_every == 0


GEMMA3_270M = Config()
SMALL = Config(vocab=512, d=64, layers=2, heads=4, kv_heads=1, head_dim=16, hidden=128, window=4)


def _block_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    return {
        "pre_attn_norm": (cfg.d,),
        "q": (cfg.d, q),
        "kv": (2, cfg.d, kv),
        "q_norm": (cfg.head_dim,),
        "k_norm": (cfg.head_dim,),
        "out": (q, cfg.d),
        "post_attn_norm": (cfg.d,),
        "pre_mlp_norm": (cfg.d,),
        "gate_up": (2, cfg.d, cfg.hidden),
        "down": (cfg.hidden, cfg.d),
        "post_mlp_norm": (cfg.d,),
    }


def init_params(cfg: Config, key: jax.Array, scan: bool, norm_scale_std: float = 0.0) -> dict:
    """Float32 parameters. Norm scales are zeros (as Gemma initialises them) unless
    ``norm_scale_std`` > 0, which draws them (tests: a zero scale hides scale errors).
    ``scan``: the blocks' parameters stacked on a leading axis, else a list of blocks."""

    def block(k):
        out = {}
        for (name, shape), kk in zip(
            _block_shapes(cfg).items(), jax.random.split(k, 11), strict=True
        ):
            if name.endswith("norm"):
                out[name] = norm_scale_std * jax.random.normal(kk, shape, jnp.float32)
            else:
                fan_in = shape[-2]
                out[name] = jax.random.normal(kk, shape, jnp.float32) / math.sqrt(fan_in)
        return out

    k_embed, k_final, *k_blocks = jax.random.split(key, cfg.layers + 2)
    blocks = [block(k) for k in k_blocks]
    if scan:
        blocks = jax.tree.map(lambda *a: jnp.stack(a), *blocks)
    return {
        "embed": jax.random.normal(k_embed, (cfg.vocab, cfg.d), jnp.float32) / math.sqrt(cfg.d),
        "blocks": blocks,
        "final_norm": norm_scale_std * jax.random.normal(k_final, (cfg.d,), jnp.float32),
    }


def param_shapes(cfg: Config, scan: bool) -> dict:
    """The parameters' ``ShapeDtypeStruct``s, without allocating them."""
    return jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), scan))


def _rope(x, positions, base: float):
    """Rotary position embedding on the last axis of ``x`` (batch, seq, heads, head_dim)."""
    half = x.shape[-1] // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[:, :, None, None].astype(jnp.float32) * freq
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def _attention(cfg: Config, norm, p, x, is_global):
    """Grouped-query attention with a QK-norm; ``is_global`` a bool or a traced bool."""
    dt = cfg.dtype
    batch, seq, _ = x.shape
    q = (x @ p["q"].astype(dt)).reshape(batch, seq, cfg.heads, cfg.head_dim)
    k, v = (x @ p["kv"][i].astype(dt) for i in range(2))
    k = k.reshape(batch, seq, cfg.kv_heads, cfg.head_dim)
    v = v.reshape(batch, seq, cfg.kv_heads, cfg.head_dim)
    q, k = norm(q, p["q_norm"]), norm(k, p["k_norm"])
    positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
    base = jnp.where(is_global, 1_000_000.0, 10_000.0)
    q, k = _rope(q, positions, base), _rope(k, positions, base)
    q = q * jnp.asarray(cfg.head_dim**-0.5, dt)
    group = cfg.heads // cfg.kv_heads
    q = q.reshape(batch, seq, cfg.kv_heads, group, cfg.head_dim)
    logits = jnp.einsum("btkgh,bskh->bkgts", q, k).astype(jnp.float32)
    i, j = jnp.arange(seq)[:, None], jnp.arange(seq)[None, :]
    allowed = j <= i
    if cfg.window is not None:
        allowed = allowed & (is_global | (i - j < cfg.window))
    logits = jnp.where(allowed, logits, -1e30)
    probs = jax.nn.softmax(logits, axis=-1).astype(dt)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v).reshape(batch, seq, -1)
    return out @ p["out"].astype(dt)


def _block(cfg: Config, norm, p, x, is_global):
    dt = cfg.dtype
    x = x + norm(
        _attention(cfg, norm, p, norm(x, p["pre_attn_norm"]), is_global), p["post_attn_norm"]
    )
    y = norm(x, p["pre_mlp_norm"])
    gate, up = (y @ p["gate_up"][i].astype(dt) for i in range(2))
    y = (jax.nn.gelu(gate) * up) @ p["down"].astype(dt)
    return x + norm(y, p["post_mlp_norm"])


def logits_fn(cfg: Config, norm, params, tokens, scan: bool):
    """Logits (batch, seq, vocab) in the activation dtype."""
    dt = cfg.dtype
    embed = params["embed"]
    x = (embed[tokens] * math.sqrt(cfg.d)).astype(dt)
    if scan:
        flags = jnp.array([cfg.is_global(i) for i in range(cfg.layers)])

        def body(x, p_flag):
            p, flag = p_flag
            return _block(cfg, norm, p, x, flag), None

        x, _ = lax.scan(body, x, (params["blocks"], flags))
    else:
        for i, p in enumerate(params["blocks"]):
            x = _block(cfg, norm, p, x, cfg.is_global(i))
    x = norm(x, params["final_norm"])
    return x @ embed.astype(dt).T


def loss_fn(cfg: Config, norm, params, tokens, targets, scan: bool):
    """Mean next-token cross-entropy; the log-sum-exp in float32 on bfloat16 logits.

    Written out rather than through a float32 log-softmax, which would keep a float32
    copy of the (tokens x 262,144) logits alive for the backward pass."""
    logits = logits_fn(cfg, norm, params, tokens, scan)
    lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(lse - picked.astype(jnp.float32))


def optimizer() -> optax.GradientTransformation:
    return optax.adamw(1e-4, weight_decay=0.01)


def gemma_train_step(cfg: Config, norm, scan: bool):
    """``step(params, opt_state, tokens, targets) -> (params, opt_state, loss)``."""
    opt = optimizer()

    def step(params, opt_state, tokens, targets):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(cfg, norm, p, tokens, targets, scan))(
            params
        )
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def gemma_step_shapes(cfg: Config, scan: bool, batch: int, seq: int):
    """``(params, opt_state, tokens, targets)`` as ``ShapeDtypeStruct``s."""
    params = param_shapes(cfg, scan)
    opt_state = jax.eval_shape(optimizer().init, params)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return params, opt_state, tokens, tokens


def gemma_inputs(cfg: Config, scan: bool, batch: int, seq: int):
    """``(params, opt_state, tokens, targets)`` on the default device: random tokens, the
    next token as the target, Gemma's zero norm scales."""
    tokens = jax.random.randint(jax.random.key(0), (batch, seq + 1), 0, cfg.vocab)
    params = init_params(cfg, jax.random.key(1), scan)
    return params, optimizer().init(params), tokens[:, :-1], tokens[:, 1:]


# ---------------------------------------------------------------- the MaxText-shaped decoder


@dataclasses.dataclass(frozen=True)
class MaxTextConfig:
    """The shape of a Llama2-style decoder as MaxText builds it (``decoder_block: llama2``).

    The defaults are the tables' moderate size, a 4-layer cut of MaxText's ``llama2-7b``
    widths scaled to compile in minutes on two CPU cores; :data:`MAXTEXT_QUICK` is the
    smoke-run size."""

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
    """MaxText's ``remat_policy``: ``"full"`` checkpoints each layer saving nothing (the
    whole layer's forward is recomputed in the backward), ``"minimal"`` saves the matmuls
    without batch dimensions (the projections, not the attention's ``q @ k``), ``"none"``
    does not checkpoint. Returns ``(checkpointed, policy)``."""
    if name == "full":
        return True, None
    if name == "minimal":
        return True, jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims
    if name == "none":
        return False, None
    raise ValueError(f"remat_policy={name!r}: expected one of {REMAT_POLICIES}")


def _maxtext_layer_shapes(cfg: MaxTextConfig) -> dict[str, tuple[int, ...]]:
    # MaxText's DenseGeneral kernels: (embed, heads, head_dim) in, (heads, head_dim, embed) out.
    return {
        "pre_self_attention_layer_norm": (cfg.d,),
        "query": (cfg.d, cfg.heads, cfg.head_dim),
        "key": (cfg.d, cfg.heads, cfg.head_dim),
        "value": (cfg.d, cfg.heads, cfg.head_dim),
        "out": (cfg.heads, cfg.head_dim, cfg.d),
        "post_self_attention_layer_norm": (cfg.d,),
        "wi_0": (cfg.d, cfg.hidden),
        "wi_1": (cfg.d, cfg.hidden),
        "wo": (cfg.hidden, cfg.d),
    }


def maxtext_init_params(
    cfg: MaxTextConfig, key: jax.Array, scan: bool, norm_scale_std: float = 0.0
) -> dict:
    """Float32 parameters: kernels ~ N(0, 1/fan_in), norm scales ones (MaxText's init)
    plus ``norm_scale_std`` x N(0, 1) where > 0 (tests: a scale of ones hides scale
    errors). ``scan``: the layers stacked on a leading axis, else a list of layers."""

    def layer(k):
        out = {}
        shapes = _maxtext_layer_shapes(cfg)
        for (name, shape), kk in zip(shapes.items(), jax.random.split(k, len(shapes)), strict=True):
            if name.endswith("norm"):
                out[name] = 1 + norm_scale_std * jax.random.normal(kk, shape, jnp.float32)
            else:
                fan_in = cfg.heads * cfg.head_dim if name == "out" else shape[0]
                out[name] = jax.random.normal(kk, shape, jnp.float32) / math.sqrt(fan_in)
        return out

    k_embed, k_logits, k_final, *k_layers = jax.random.split(key, cfg.layers + 3)
    layers = [layer(k) for k in k_layers]
    if scan:
        layers = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    final = 1 + norm_scale_std * jax.random.normal(k_final, (cfg.d,), jnp.float32)
    return {
        "token_embedder": jax.random.normal(k_embed, (cfg.vocab, cfg.d), jnp.float32),
        "layers": layers,
        "decoder_norm": final,
        "logits_dense": jax.random.normal(k_logits, (cfg.d, cfg.vocab), jnp.float32)
        / math.sqrt(cfg.d),
    }


def _maxtext_attention(cfg: MaxTextConfig, p, x):
    """Multi-head causal attention with RoPE on the query and key; the query scaled by
    ``1/sqrt(head_dim)``; the softmax in float32."""
    dt = cfg.dtype
    batch, seq, _ = x.shape
    q, k, v = (jnp.einsum("btd,dhk->bthk", x, p[n].astype(dt)) for n in ("query", "key", "value"))
    positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
    q, k = _rope(q, positions, cfg.rope_base), _rope(k, positions, cfg.rope_base)
    q = q * jnp.asarray(cfg.head_dim**-0.5, dt)
    logits = jnp.einsum("bthk,bshk->bhts", q, k).astype(jnp.float32)
    causal = jnp.arange(seq)[:, None] >= jnp.arange(seq)[None, :]
    logits = jnp.where(causal, logits, -1e30)
    probs = jax.nn.softmax(logits, axis=-1).astype(dt)
    out = jnp.einsum("bhts,bshk->bthk", probs, v)
    return jnp.einsum("bthk,hkd->btd", out, p["out"].astype(dt))


def _maxtext_layer(cfg: MaxTextConfig, norm, p, x):
    """One llama2 decoder layer: pre-norm attention and pre-norm SwiGLU MLP, each added
    to the residual stream."""
    dt = cfg.dtype
    x = x + _maxtext_attention(cfg, p, norm(x, p["pre_self_attention_layer_norm"]))
    y = norm(x, p["post_self_attention_layer_norm"])
    gate, up = (y @ p[n].astype(dt) for n in ("wi_0", "wi_1"))
    return x + (jax.nn.silu(gate) * up) @ p["wo"].astype(dt)


def maxtext_logits(cfg: MaxTextConfig, norm, params, tokens, scan: bool, remat: str = "full"):
    """Logits (batch, seq, vocab) in float32 (MaxText's ``cast_logits_to_fp32``).

    Each layer runs under ``jax.checkpoint`` with MaxText's ``remat`` policy (scanned or
    not, as MaxText wraps its decoder layer); ``scan``: ``lax.scan`` over the stacked
    layers, else a Python loop over the list of layers."""
    dt = cfg.dtype
    checkpointed, policy = remat_policy(remat)

    def layer(x, p):
        return _maxtext_layer(cfg, norm, p, x), None

    if checkpointed:
        layer = jax.checkpoint(layer, policy=policy, prevent_cse=not scan)
    x = params["token_embedder"][tokens].astype(dt)
    if scan:
        x, _ = lax.scan(layer, x, params["layers"])
    else:
        for p in params["layers"]:
            x, _ = layer(x, p)
    x = norm(x, params["decoder_norm"])
    return (x @ params["logits_dense"].astype(dt)).astype(jnp.float32)


def maxtext_loss(cfg: MaxTextConfig, norm, params, tokens, targets, scan: bool, remat: str):
    """Mean next-token cross-entropy on the float32 logits."""
    logits = maxtext_logits(cfg, norm, params, tokens, scan, remat)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(lse - picked)


def maxtext_optimizer() -> optax.GradientTransformation:
    """MaxText's default AdamW (``adam_b1`` 0.9, ``adam_b2`` 0.95, ``adam_eps`` 1e-8,
    ``adam_weight_decay`` 0.1)."""
    return optax.adamw(1e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)


def maxtext_train_step(cfg: MaxTextConfig, norm, scan: bool, remat: str = "full"):
    """``step(params, opt_state, tokens, targets) -> (params, opt_state, loss)``: loss,
    gradient and an AdamW update; ``norm(x, scale) -> y`` in ``x``'s dtype with ``scale``
    the stored float32 parameter (``peers.MAXTEXT_NORMS``)."""
    opt = maxtext_optimizer()

    def step(params, opt_state, tokens, targets):
        loss, grads = jax.value_and_grad(
            lambda p: maxtext_loss(cfg, norm, p, tokens, targets, scan, remat)
        )(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def maxtext_step_shapes(cfg: MaxTextConfig, scan: bool, batch: int, seq: int):
    """``(params, opt_state, tokens, targets)`` as ``ShapeDtypeStruct``s."""
    params = jax.eval_shape(lambda: maxtext_init_params(cfg, jax.random.key(0), scan))
    opt_state = jax.eval_shape(maxtext_optimizer().init, params)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return params, opt_state, tokens, tokens
