"""The implementations the benchmarks compare, their baselines, and a train-step model.

Shared by ``bench.py`` (XLA:CPU timings), ``aot_bench.py`` (the TPU and GPU compilers'
estimates) and ``device_bench.py`` (device time on a GPU or TPU), so all three measure
exactly the same programs.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

import rmsnorm_jax

EPS = 1e-6


def plain_formula(x, scale):
    """What a user writes by hand: float32 statistics, autodiff for the gradient."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + EPS) * scale
    return y.astype(jnp.result_type(x, scale))


def _module(cls, **kw) -> Callable:
    module = cls(epsilon=EPS, **kw)

    def apply(x, scale):
        params = {"scale": scale}
        if cls is nn.LayerNorm:
            params["bias"] = jnp.zeros_like(scale)
        return module.apply({"params": params}, x)

    return apply


IMPLEMENTATIONS: dict[str, Callable] = {
    "rms_norm": lambda x, s: rmsnorm_jax.rms_norm(x, s, EPS),
    "rms_norm p=0.0625": lambda x, s: rmsnorm_jax.rms_norm(x, s, EPS, p=0.0625),
    "RMSNorm module": _module(rmsnorm_jax.RMSNorm),
    "flax RMSNorm": _module(nn.RMSNorm),
    "flax LayerNorm": _module(nn.LayerNorm),
    "jnp + autodiff": plain_formula,
}


def forward_backward(fn):
    """``(y, (dx, dscale))`` of ``fn`` for the cotangent ``dy``: one jitted program."""

    def run(x, scale, dy):
        y, vjp = jax.vjp(fn, x, scale)
        return y, vjp(dy)

    return run


def random_inputs(rows: int, features: int, dtype):
    """``(x, other, scale, dy)`` of one benchmark shape: x, the residual stream or gate, and
    the cotangent standard normal, the scale near 1; the same seed for every program."""
    kx, ko, ks, kd = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(kx, (rows, features), jnp.float32).astype(dtype)
    other = jax.random.normal(ko, (rows, features), jnp.float32).astype(dtype)
    scale = (1 + 0.1 * jax.random.normal(ks, (features,), jnp.float32)).astype(dtype)
    dy = jax.random.normal(kd, (rows, features), jnp.float32).astype(dtype)
    return x, other, scale, dy


def copy_baseline(x, scale):
    del scale
    return x * 2


def traffic_baseline(x, scale, dy):
    del scale
    return x * 2, x * dy


# Only multiplies by the scale: the least any norm with a learnable scale can keep for
# its backward when a matmul follows it (x for the scale's gradient; the matmul keeps
# the output). Not a norm; the floor of the train-step memory table.
def scale_only(x, scale):
    return x * scale


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


def _flax_rms_norm(x, scale):
    return nn.RMSNorm(epsilon=EPS).apply({"params": {"scale": scale}}, x)


# The fused LLM-layer ops beside what a user writes by hand with flax's norm. Each takes
# (x, other, scale): other is the residual stream or the gate.
FUSED: dict[str, Callable] = {
    "add_rms_norm": lambda x, r, s: rmsnorm_jax.add_rms_norm(x, r, s, EPS),
    "flax RMSNorm + add": lambda x, r, s: (_flax_rms_norm(x + r, s), x + r),
    "gated_rms_norm": lambda x, z, s: rmsnorm_jax.gated_rms_norm(x, z, s, EPS),
    "flax RMSNorm * silu": lambda x, z, s: _flax_rms_norm(x, s) * jax.nn.silu(z),
}


def fused_forward_backward(fn):
    """Outputs and the gradients for (x, other, scale), cotangent ``dy`` for every output."""

    def run(x, other, scale, dy):
        out, vjp = jax.vjp(fn, x, other, scale)
        cts = jax.tree.map(lambda o: dy.astype(o.dtype), out)
        return out, vjp(cts)

    return run


def fused_residual_bytes(fn, x, other, scale) -> int:
    """Bytes the backward pass keeps alive (``jax.vjp``'s residuals)."""
    _, vjp = jax.vjp(fn, x, other, scale)
    return sum(leaf.nbytes for leaf in jax.tree.leaves(vjp))
