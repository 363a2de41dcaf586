"""The model: a pre-norm decoder-only Transformer over bytes whose norms are RMSNorm."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

import rmsnorm_jax

from .config import Config

# Logical axis -> mesh axis. Attention heads and the MLP hidden units are split over
# "model" (Megatron-style); the batch over "data"; the residual stream is replicated
# across "model", so the norms need no collective.
LOGICAL_RULES = (
    ("batch", "data"),
    ("heads", "model"),
    ("mlp", "model"),
    ("vocab", None),
    ("embed", None),
    ("kv", None),
    ("length", None),
)


def _dense_init(names: tuple[str | None, ...], scale: float = 1.0):
    return nn.with_logical_partitioning(nn.initializers.normal(0.02 * scale), names)


def make_norm(cfg: Config) -> nn.Module:
    """The run's norm: ``rmsnorm_jax.RMSNorm`` (``p`` < 1 for pRMSNorm) or flax's LayerNorm."""
    if cfg.norm == "layernorm":
        return nn.LayerNorm(
            epsilon=1e-6,
            scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
        )
    p = cfg.p if cfg.norm == "prmsnorm" else 1.0
    return rmsnorm_jax.RMSNorm(epsilon=1e-6, p=p, logical_axes=("embed",))


def add_and_norm(cfg: Config, x: jax.Array, residual: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``h = residual + x`` and ``norm(h)``: one fused op (``add_rms_norm``) with RMSNorm,
    whose backward keeps only ``h``; written out for flax's LayerNorm."""
    if cfg.norm == "layernorm":
        h = residual + x
        return make_norm(cfg)(h), h
    return make_norm(cfg)(x, residual=residual)


class Block(nn.Module):
    """Causal self-attention and a GELU MLP, each after a norm, each added to the stream."""

    cfg: Config

    @nn.compact
    def __call__(self, h: jax.Array) -> jax.Array:
        cfg = self.cfg
        head_dim = cfg.d_model // cfg.num_heads
        depth_scale = 1 / math.sqrt(2 * cfg.num_layers)
        x = make_norm(cfg)(h)
        # nn.Einsum rather than nn.DenseGeneral: DenseGeneral initialises a flat 2-D
        # kernel and reshapes it, which under a mesh (e.g. `--compile-for`) applies the
        # 4-D logical sharding to the 2-D value and fails.
        qkv = nn.Einsum(
            (cfg.d_model, 3, cfg.num_heads, head_dim),
            "bld,dthk->blthk",
            use_bias=False,
            kernel_init=_dense_init(("embed", None, "heads", "kv")),
        )(x)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
        causal = jnp.tril(jnp.ones((h.shape[1], h.shape[1]), bool))
        weights = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
        attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        attention_out = nn.Einsum(
            (cfg.num_heads, head_dim, cfg.d_model),
            "blhk,hkd->bld",
            use_bias=False,
            kernel_init=_dense_init(("heads", "kv", "embed"), depth_scale),
        )(attended)
        x, h = add_and_norm(cfg, attention_out, h)
        x = nn.Dense(
            cfg.mlp_ratio * cfg.d_model, use_bias=False, kernel_init=_dense_init(("embed", "mlp"))
        )(x)
        x = nn.Dense(
            cfg.d_model, use_bias=False, kernel_init=_dense_init(("mlp", "embed"), depth_scale)
        )(jax.nn.gelu(x))
        return h + x


class TransformerLM(nn.Module):
    """Pre-norm decoder-only Transformer over bytes, with a final norm and tied output."""

    cfg: Config

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.cfg
        embed = nn.Embed(
            256,
            cfg.d_model,
            # std 1/sqrt(d): with the tied output head and the final norm, the initial
            # logits are O(1) and the first loss is near log(256), not a confident copy.
            embedding_init=nn.with_logical_partitioning(
                nn.initializers.normal(cfg.d_model**-0.5), ("vocab", "embed")
            ),
        )
        pos = self.param(
            "pos_embedding",
            nn.with_logical_partitioning(nn.initializers.normal(0.02), ("length", "embed")),
            (cfg.seq_len, cfg.d_model),
        )
        h = embed(tokens) + pos[: tokens.shape[1]]
        h = nn.with_logical_constraint(h, ("batch", "length", "embed"))
        for _ in range(cfg.num_layers):
            h = Block(cfg)(h)
        return embed.attend(make_norm(cfg)(h)) / math.sqrt(cfg.d_model)
