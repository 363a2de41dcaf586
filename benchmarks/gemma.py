"""A Gemma-3-style decoder and its train step, with a pluggable RMSNorm.

Written here from the public architecture (flax's ``examples/gemma`` is the reference;
nothing is downloaded): token embeddings tied with the output layer and scaled by
``sqrt(d)``; per block a pre- and a post-norm around attention and around the MLP, all
``(1 + scale)`` norms with zero-initialised scales; grouped-query attention with RoPE and a
QK-norm over the head dimension; a gelu-gated MLP; local (sliding-window) and global
layers mixed five to one; a final norm. Parameters are float32, activations bfloat16.

The norm is a function ``norm(x, scale) -> y`` with ``y`` in ``x``'s dtype, where
``scale`` is the stored (zero-centred) parameter: every norm below computes
``y = x / RMS(x) * (1 + scale)``, each the way one library or model writes it.

``train_step(cfg, norm, scan)``: cross-entropy loss, gradient and an AdamW update
(optax). ``scan=False`` unrolls the blocks in Python (as flax's example does);
``scan=True`` stacks their parameters and runs them under ``lax.scan``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import lax

import rmsnorm_jax

EPS = 1e-6


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


# --- The norms compared: y = x / RMS(x) * (1 + scale), in x's dtype. ------------------


def ours(x, scale):
    """``rmsnorm_jax.rms_norm`` with ``scale_offset=1.0``."""
    return rmsnorm_jax.rms_norm(x, scale, EPS, scale_offset=1.0, dtype=x.dtype)


def flax_linen(x, scale):
    """``flax.linen.RMSNorm`` on the parameter ``1 + scale``."""
    module = nn.RMSNorm(epsilon=EPS, dtype=x.dtype)
    return module.apply({"params": {"scale": 1 + scale}}, x)


def flax_nnx(x, scale):
    """``flax.nnx.RMSNorm`` on the parameter ``1 + scale``."""
    module = nnx.RMSNorm(
        x.shape[-1],
        epsilon=EPS,
        dtype=x.dtype,
        param_dtype=scale.dtype,
        scale_init=lambda key, shape, dtype: (1 + scale).astype(dtype),
        rngs=nnx.Rngs(0),
    )
    return module(x)


def plain_formula(x, scale):
    """What a user writes by hand: all in float32, autodiff for the gradient."""
    xf = x.astype(jnp.float32)
    y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + EPS)
    return (y * (1 + scale.astype(jnp.float32))).astype(x.dtype)


def gemma_formula(x, scale):
    """Gemma's own norm: normalise in float32, then ``(1 + scale)`` in x's dtype."""
    xf = x.astype(jnp.float32)
    normed = (xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + EPS)).astype(x.dtype)
    return normed * (1 + scale.astype(x.dtype))


def scale_only(x, scale):
    """Not a norm: ``x * (1 + scale)`` in x's dtype. What any norm with a learnable scale
    keeps for its backward (``x``, for the scale's gradient) and nothing more: the
    floor of the memory tables."""
    return x * (1 + scale.astype(x.dtype))


FLOOR = "x * (1 + scale) (floor)"

NORMS: dict[str, Callable] = {
    "rms_norm": ours,
    "gemma's own": gemma_formula,
    "flax nnx RMSNorm": flax_nnx,
    "jnp + autodiff": plain_formula,
    "flax linen RMSNorm": flax_linen,
}


# --- The model. ----------------------------------------------------------------------


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


def train_step(cfg: Config, norm, scan: bool):
    """``step(params, opt_state, tokens, targets) -> (params, opt_state, loss)``."""
    opt = optimizer()

    def step(params, opt_state, tokens, targets):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(cfg, norm, p, tokens, targets, scan))(
            params
        )
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def step_shapes(cfg: Config, scan: bool, batch: int, seq: int):
    """``(params, opt_state, tokens, targets)`` as ``ShapeDtypeStruct``s."""
    params = param_shapes(cfg, scan)
    opt_state = jax.eval_shape(optimizer().init, params)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return params, opt_state, tokens, tokens
