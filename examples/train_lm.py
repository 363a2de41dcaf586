"""Train a small byte-level decoder-only Transformer whose norms are rmsnorm_jax.RMSNorm.

One code path for TPU pods, GPUs and this CPU: a ("data", "model") mesh over all
devices, parameters and batches placed through logical axis names, a pure jitted
train step. The default corpus is the Python documentation's topic texts that ship
with Python itself (``pydoc_data.topics``), so nothing is downloaded.

    python examples/train_lm.py                          # RMSNorm, default config
    python examples/train_lm.py --norm prmsnorm --p 0.0625 --workdir runs/prmsnorm
    python examples/train_lm.py --compare                # RMSNorm vs pRMSNorm vs LayerNorm
    python examples/train_lm.py --resume --steps 1000    # continue runs/train_lm's run
    python examples/train_lm.py --overwrite              # delete it and start afresh
    python examples/train_lm.py --data my.txt --steps 2000 --workdir runs/mine
    python examples/train_lm.py --mesh 4,2               # data=4, model=2 devices
    python examples/train_lm.py --compile-for tpu-v5e:4x4 --mesh 8,2 --d-model 2048
                                 # compile the sharded step for a pod, print its memory

Writes ``<workdir>/config.json`` (the run's Config), orbax checkpoints under
``<workdir>/checkpoints``, ``<workdir>/metrics.json`` (per-step train loss and step
time, eval losses) and ``<workdir>/loss.png``, and names them in its last lines;
``--compare`` writes one such workdir per norm under ``<workdir>``, and
``<workdir>/compare.png``, ``compare.md`` and ``compare.json``. A workdir that already
holds a run is refused unless ``--resume`` continues it (same config, see
``MAY_DIFFER_ON_RESUME``) or ``--overwrite`` deletes it first: two runs never mix.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if "JAX_PLATFORMS" not in os.environ and (
    "--compile-for" in sys.argv
    # No device file of an accelerator (NVIDIA, AMD, TPU), read before jax is imported.
    or not any(map(glob.glob, ("/dev/nvidia*", "/dev/kfd", "/dev/accel*", "/dev/vfio/[0-9]*")))
):
    # Deviceless compiles for TPU/GPU need the CPU runtime alone (rmsnorm_jax.aot). And on
    # a machine without an accelerator, jax would otherwise try the CUDA plugin and libtpu
    # that the `aot` and `test` extras install, printing some 30 lines of errors before
    # it falls back to the CPU (docs/development.md). Set before jax is imported.
    os.environ["JAX_PLATFORMS"] = "cpu"

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import rmsnorm_jax

NORMS = ("rmsnorm", "prmsnorm", "layernorm")

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


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything that defines a run. The defaults finish in minutes on a 2-core CPU.

    ``steps`` is where training stops. The learning rate warms up linearly over
    ``warmup_steps`` and decays as a cosine to a tenth at ``schedule_steps`` (None:
    ``steps``), then stays there. A run saves this config as ``<workdir>/config.json``;
    ``--resume`` may change only the fields in ``MAY_DIFFER_ON_RESUME``, so a resumed
    run keeps its schedule even when it stops at another step.
    """

    norm: str = "rmsnorm"
    p: float = 0.0625
    steps: int = 600
    schedule_steps: int | None = None  # None: steps (on --resume: the saved run's)
    batch_size: int = 32
    seq_len: int = 128
    d_model: int = 128
    num_heads: int = 4
    num_layers: int = 3
    mlp_ratio: int = 4
    learning_rate: float = 3e-3
    warmup_steps: int | None = 60  # None: a tenth of the schedule, 1 to 60 (the CLI's)
    weight_decay: float = 0.1
    eval_every: int = 100
    eval_batches: int = 8
    checkpoint_every: int = 200
    seed: int = 0
    mesh: tuple[int, int] | None = None  # (data, model); default (all devices, 1)
    data: str | None = None
    val_fraction: float = 0.1
    progress: bool = True


# What ``--resume`` may change: where the run stops, how often it evaluates and saves, how
# it reports, and the device layout (the same maths; the losses then agree to float
# rounding, not bit for bit). Everything else (model, data and its split, seed,
# optimizer, schedule) must equal the saved run's, or the result would mix two runs.
MAY_DIFFER_ON_RESUME = ("steps", "eval_every", "checkpoint_every", "mesh", "progress")


def schedule_of(cfg: Config) -> tuple[int, int]:
    """``(warmup_steps, schedule_steps)`` with the None defaults filled in."""
    length = cfg.schedule_steps or cfg.steps
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, min(60, length // 10))
    return warmup, length


# ---------------------------------------------------------------- data


def load_corpus(path: str | None) -> bytes:
    """The user's text file, or the pydoc topics that ship with Python."""
    if path is None:
        from pydoc_data.topics import topics

        return "".join(topics[k] for k in sorted(topics)).encode("utf-8")
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--data {path}: no such file")
    data = file.read_bytes()
    if not data:
        raise ValueError(f"--data {path}: the file is empty")
    return data


def split_tokens(corpus: bytes, cfg: Config) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.frombuffer(corpus, np.uint8).astype(np.int32)
    n_val = max(int(len(tokens) * cfg.val_fraction), cfg.seq_len + 2)
    train, val = tokens[:-n_val], tokens[-n_val:]
    if len(train) < cfg.seq_len + 2:
        raise ValueError(
            f"the corpus has {len(tokens)} bytes; need more than {2 * (cfg.seq_len + 2)} "
            f"for seq_len={cfg.seq_len} and a validation split"
        )
    return train, val


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy in nats of the byte distribution: the loss of the best context-free model."""
    counts = np.bincount(tokens, minlength=256)
    probs = counts[counts > 0] / counts.sum()
    return float(-(probs * np.log(probs)).sum())


def batch_at(tokens: np.ndarray, step: int, cfg: Config, seed: int) -> np.ndarray:
    """The batch for ``step``: a pure function of (seed, step), so a resumed run sees
    exactly the data order of an uninterrupted one."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - cfg.seq_len - 1, size=cfg.batch_size)
    return np.stack([tokens[s : s + cfg.seq_len + 1] for s in starts])


def eval_batches(tokens: np.ndarray, cfg: Config) -> list[np.ndarray]:
    """Fixed, evenly spaced validation windows."""
    count = cfg.eval_batches * cfg.batch_size
    starts = np.linspace(0, len(tokens) - cfg.seq_len - 1, count).astype(int)
    windows = np.stack([tokens[s : s + cfg.seq_len + 1] for s in starts])
    return list(windows.reshape(cfg.eval_batches, cfg.batch_size, -1))


# ---------------------------------------------------------------- model


def _dense_init(names: tuple[str | None, ...], scale: float = 1.0):
    return nn.with_logical_partitioning(nn.initializers.normal(0.02 * scale), names)


def make_norm(cfg: Config) -> nn.Module:
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


# ---------------------------------------------------------------- training


def make_mesh(cfg: Config, devices: list | None = None) -> jax.sharding.Mesh:
    """The ("data", "model") mesh over ``devices`` (default: this run's devices)."""
    if devices is None:
        shape = cfg.mesh or (jax.device_count(), 1)
        return jax.make_mesh(shape, ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    shape = cfg.mesh or (len(devices), 1)
    return jax.sharding.Mesh(
        np.array(devices, dtype=object).reshape(shape),
        ("data", "model"),
        axis_types=(jax.sharding.AxisType.Auto,) * 2,
    )


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    warmup, length = schedule_of(cfg)
    warmup = min(warmup, length - 1)  # the cosine needs at least one step
    # Past `length` optax holds the end value: a run resumed beyond its schedule goes on
    # at a tenth of the peak learning rate.
    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        cfg.learning_rate,
        max(warmup, 0),
        max(length, warmup + 1),
        end_value=cfg.learning_rate / 10,
    )
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b2=0.95, weight_decay=cfg.weight_decay),
    )


def loss_fn(params: Any, model: nn.Module, batch: jax.Array) -> jax.Array:
    logits = model.apply({"params": params}, batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


class Trainer:
    """Builds the sharded state and the jitted steps for one configuration."""

    def __init__(self, cfg: Config, devices: list | None = None):
        self.cfg = cfg
        self.mesh = make_mesh(cfg, devices)
        self.model = TransformerLM(cfg)
        self.optimizer = make_optimizer(cfg)
        dummy = jnp.zeros((cfg.batch_size, cfg.seq_len), jnp.int32)

        def init_boxed(key):
            # Parameters boxed with their logical axis names; Adam's moments, made by
            # tree-mapping over the parameters, carry the same names.
            params = self.model.init(key, dummy)["params"]
            return {"params": params, "opt_state": self.optimizer.init(params)}

        def init(key):
            return nn.meta.unbox(init_boxed(key))

        abstract_boxed = jax.eval_shape(init_boxed, jax.random.key(0))
        self.state_shardings = nn.logical_to_mesh_sharding(
            nn.get_partition_spec(abstract_boxed), self.mesh, LOGICAL_RULES
        )
        replicated = NamedSharding(self.mesh, P())
        self.batch_sharding = NamedSharding(self.mesh, P("data", None))
        self.abstract_state = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            nn.meta.unbox(abstract_boxed),
            self.state_shardings,
        )
        self.init = jax.jit(init, out_shardings=self.state_shardings)

        def train_step(state, batch):
            with nn.logical_axis_rules(LOGICAL_RULES):
                loss, grads = jax.value_and_grad(loss_fn)(state["params"], self.model, batch)
            updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
            params = optax.apply_updates(state["params"], updates)
            return {"params": params, "opt_state": opt_state}, loss

        def eval_step(params, batch):
            with nn.logical_axis_rules(LOGICAL_RULES):
                return loss_fn(params, self.model, batch)

        self.train_step = jax.jit(
            train_step,
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, replicated),
            donate_argnums=0,
        )
        self.eval_step = jax.jit(
            eval_step,
            in_shardings=(self.state_shardings["params"], self.batch_sharding),
            out_shardings=replicated,
        )

    def put_batch(self, batch: np.ndarray) -> jax.Array:
        """A global batch on the mesh; every process builds the same batch, so this also
        works when the run spans several hosts."""
        return jax.make_array_from_callback(batch.shape, self.batch_sharding, lambda i: batch[i])

    def evaluate(self, params, batches: list[np.ndarray]) -> float:
        return float(np.mean([self.eval_step(params, self.put_batch(b)) for b in batches]))


# ---------------------------------------------------------------- the workdir


def run_files(workdir: str | Path) -> dict[str, Path]:
    """Where a run keeps its files in ``workdir``: what ``--overwrite`` removes."""
    workdir = Path(workdir)
    return {
        "checkpoints": workdir / "checkpoints",
        "config": workdir / "config.json",
        "metrics": workdir / "metrics.json",
        "plot": workdir / "loss.png",
    }


def checkpoint_steps(workdir: str | Path) -> list[int]:
    """The steps saved under ``<workdir>/checkpoints``. Orbax names a finished checkpoint
    by its step; one that a killed run left half-written has a temporary suffix and is
    not counted (nor restored)."""
    path = run_files(workdir)["checkpoints"]
    if not path.is_dir():
        return []
    return sorted(int(p.name) for p in path.iterdir() if p.name.isdigit())


def _steps_in_words(steps: list[int]) -> str:
    return f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}"


def _previous_run(workdir: Path) -> list[str]:
    """What ``workdir`` holds of an earlier run, in words; empty when nothing."""
    found = []
    for name, path in run_files(workdir).items():
        if name == "checkpoints":
            if path.is_dir() and any(path.iterdir()):
                steps = checkpoint_steps(workdir)
                found.append(
                    f"checkpoints at {_steps_in_words(steps)}"
                    if steps
                    else "an unfinished checkpoint"
                )
        elif path.exists():
            found.append(path.name)
    return found


def _config_json(cfg: Config) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(cfg)))  # tuples as JSON lists


def _config_from_json(saved: dict[str, Any]) -> Config:
    known = {f.name for f in dataclasses.fields(Config)}
    values = {k: v for k, v in saved.items() if k in known}
    if values.get("mesh") is not None:
        values["mesh"] = tuple(values["mesh"])
    return Config(**values)


def _against_saved(cfg: Config, saved: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``cfg`` as JSON with the saved run's schedule where ``cfg`` leaves it None, and the
    fields outside ``MAY_DIFFER_ON_RESUME`` in which it differs from ``saved``, in words."""
    requested = _config_json(cfg)
    for name in ("schedule_steps", "warmup_steps"):
        if requested[name] is None:
            requested[name] = saved.get(name)
    differing = [
        f"{name} (saved {saved.get(name, 'nothing')!r}, now {requested.get(name, 'nothing')!r})"
        for name in sorted(set(saved) | set(requested))
        if name not in MAY_DIFFER_ON_RESUME and saved.get(name) != requested.get(name)
    ]
    return requested, differing


def _is_retry(cfg: Config, workdir: Path) -> bool:
    """Whether ``workdir`` holds only what a start of this same config left before its
    first checkpoint (a failed or interrupted start: config.json, perhaps an unfinished
    checkpoint; no finished checkpoint, no metrics, no plot). Nothing was trained there,
    so the same command may start again from step 0, as ``--resume`` would."""
    files = run_files(workdir)
    if checkpoint_steps(workdir) or files["metrics"].exists() or files["plot"].exists():
        return False
    try:
        saved = json.loads(files["config"].read_text())
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and not _against_saved(cfg, saved)[1]


def plan_run(cfg: Config, workdir: str | Path, resume: bool, overwrite: bool) -> Config:
    """The config that a run of ``cfg`` in ``workdir`` trains with, or a ValueError that
    says why it may not run there. Changes nothing on disk.

    A workdir that holds a run needs ``resume`` (continue it) or ``overwrite`` (start
    afresh), except where that run saved nothing and has this config (``_is_retry``: a
    start that failed before its first checkpoint; it starts again). On resume the saved
    ``config.json`` must agree with ``cfg`` in every field outside
    ``MAY_DIFFER_ON_RESUME``; ``schedule_steps`` and ``warmup_steps`` left None are the
    saved run's.
    """
    if resume and overwrite:
        raise ValueError("--resume and --overwrite exclude each other: pass one")
    workdir = Path(workdir)
    previous = _previous_run(workdir)
    if previous and not (resume or overwrite):
        if _is_retry(cfg, workdir):
            return plan_run(cfg, workdir, resume=True, overwrite=False)
        raise ValueError(
            f"{workdir} already holds a run ({', '.join(previous)}): pass --resume to "
            f"continue it, --overwrite to delete it and start afresh, or another --workdir"
        )
    config_file = run_files(workdir)["config"]
    if not resume or not config_file.exists():
        if resume and previous:
            raise ValueError(
                f"{workdir} holds {', '.join(previous)} but no config.json (an older "
                f"version of this example, or a deleted file), so --resume cannot check "
                f"that they belong to this config: pass --overwrite to start afresh"
            )
        warmup, length = schedule_of(cfg)
        return dataclasses.replace(cfg, warmup_steps=warmup, schedule_steps=length)
    saved = json.loads(config_file.read_text())
    requested, differing = _against_saved(cfg, saved)
    if differing:
        raise ValueError(
            f"--resume: this command's config differs from the run saved in {config_file} "
            f"in {'; '.join(differing)}. Only {', '.join(MAY_DIFFER_ON_RESUME)} may change "
            f"on resume: rerun with the saved values, or pass --overwrite to start afresh"
        )
    return _config_from_json(requested)


def _say(text: str) -> None:
    if jax.process_index() == 0:
        print(text, flush=True)


def decided_by_process_0(decide: Callable[[], Any]) -> Any:
    """``decide()`` run on process 0 alone, and its answer (anything JSON can hold) given
    to every process; a ``ValueError`` it raises is raised on every process.

    The workdir is read and changed by process 0 only: were every process to check it,
    one would find the ``config.json`` that process 0 had just written and refuse the
    run. The others wait here until process 0 has decided and acted (a barrier, and a
    no-op on one process)."""
    if jax.process_count() == 1:
        return decide()
    from jax.experimental import multihost_utils

    message = b""
    if jax.process_index() == 0:
        try:
            message = json.dumps({"answer": decide()}).encode()
        except ValueError as err:
            message = json.dumps({"error": str(err)}).encode()
    size = int(multihost_utils.broadcast_one_to_all(np.int32(len(message))))
    buffer = np.frombuffer(message, np.uint8) if message else np.zeros(size, np.uint8)
    received = json.loads(np.asarray(multihost_utils.broadcast_one_to_all(buffer)).tobytes())
    if "error" in received:
        raise ValueError(received["error"])
    return received["answer"]


def _remove_run(workdir: Path) -> None:
    for path in run_files(workdir).values():
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def prepare_workdir(
    cfg: Config, workdir: Path, resume: bool, overwrite: bool
) -> tuple[Config, int | None]:
    """Checks ``workdir`` (``plan_run``), prepares it for the run and says what it did:
    ``(the config to train, the checkpoint step to resume from or None)``. On process 0
    only (``decided_by_process_0``); nothing is changed when the run is refused or has
    nothing to train."""

    def decide() -> dict:
        previous = _previous_run(workdir)
        planned = plan_run(cfg, workdir, resume, overwrite)
        steps = checkpoint_steps(workdir) if resume else []
        latest = steps[-1] if steps else None
        if latest is not None and latest >= planned.steps:
            return {"config": _config_json(planned), "latest": latest}
        if overwrite and previous:
            _remove_run(workdir)
            print(f"--overwrite: removed the previous run in {workdir} ({', '.join(previous)})")
        elif previous and not resume:  # a retry (plan_run): nothing trained there
            print(
                f"{workdir} holds what a start of this command left before its first "
                f"checkpoint ({', '.join(previous)}): nothing was trained, starting from step 0"
            )
        workdir.mkdir(parents=True, exist_ok=True)
        run_files(workdir)["config"].write_text(json.dumps(_config_json(planned), indent=1) + "\n")
        sys.stdout.flush()
        return {"config": _config_json(planned), "latest": latest}

    decided = decided_by_process_0(decide)
    return _config_from_json(decided["config"]), decided["latest"]


# ---------------------------------------------------------------- training loop


def _checkpoint_manager(workdir: Path):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(
        run_files(workdir)["checkpoints"].absolute(),
        options=ocp.CheckpointManagerOptions(max_to_keep=2),  # saves: train_and_evaluate
    )


def train_and_evaluate(
    cfg: Config, workdir: str | Path, resume: bool = False, overwrite: bool = False
) -> dict:
    """Trains ``cfg`` and writes config, checkpoints, metrics and plot under ``workdir``.

    A workdir that already holds a run is refused unless ``resume`` (continue from its
    latest checkpoint, printing "resumed from step N"; the config must match, see
    ``plan_run``) or ``overwrite`` (remove the old run's files, ``run_files``, and start
    afresh). Resuming a run already at ``cfg.steps`` or beyond trains nothing, says so,
    and changes no file.

    Returns the metrics dict (also written to ``<workdir>/metrics.json``); its
    ``steps_trained`` is the number of steps this call trained.
    """
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    workdir = Path(workdir)
    cfg, latest = prepare_workdir(cfg, workdir, resume, overwrite)
    files = run_files(workdir)
    train_tokens, val_tokens = split_tokens(load_corpus(cfg.data), cfg)
    metrics: dict[str, Any] = {
        "config": dataclasses.asdict(cfg),
        "devices": jax.device_count(),
        "platform": jax.devices()[0].platform,
        "mesh": None,
        "unigram_entropy": unigram_entropy(train_tokens),
        "train_loss": [],
        "step_time": [],
        "eval": [],
        "resumed_from": None,
        "steps_trained": 0,
    }
    saved_metrics_keys = ("train_loss", "step_time", "eval")

    if latest is not None and latest >= cfg.steps:
        manager = _checkpoint_manager(workdir)
        restored = manager.restore(latest, args=ocp.args.Composite(metrics=ocp.args.JsonRestore()))
        manager.close()
        metrics.update({k: restored["metrics"][k] for k in saved_metrics_keys})
        metrics.update(mesh=dict(make_mesh(cfg).shape), resumed_from=latest)
        metrics["final_eval_loss"] = metrics["eval"][-1]["loss"] if metrics["eval"] else None
        metrics["wall_time"] = sum(metrics["step_time"])
        _say(
            f"nothing to train: the run in {workdir} is at step {latest} and --steps is "
            f"{cfg.steps}; pass a larger --steps to train on (no file was changed)"
        )
        return metrics

    val = eval_batches(val_tokens, cfg)
    trainer = Trainer(cfg)
    metrics["mesh"] = dict(trainer.mesh.shape)
    manager = _checkpoint_manager(workdir)
    start = 0
    if latest is not None:
        start = latest
        restored = manager.restore(
            start,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(trainer.abstract_state),
                metrics=ocp.args.JsonRestore(),
            ),
        )
        state = restored["state"]
        metrics.update({k: restored["metrics"][k] for k in saved_metrics_keys})
        metrics["resumed_from"] = start
        _say(f"resumed from step {start} of {files['checkpoints']}, training to step {cfg.steps}")
    else:
        if resume:
            _say(f"--resume: no checkpoint in {files['checkpoints']} yet; training from step 0")
        state = trainer.init(jax.random.key(cfg.seed))

    elapsed = sum(metrics["step_time"])
    bar = tqdm(
        range(start, cfg.steps),
        initial=start,
        total=cfg.steps,
        desc=cfg.norm,
        disable=not cfg.progress or jax.process_index() != 0,
        dynamic_ncols=True,
    )
    tokens_per_step = cfg.batch_size * cfg.seq_len
    try:
        for step in bar:
            batch = trainer.put_batch(batch_at(train_tokens, step, cfg, cfg.seed))
            t0 = time.perf_counter()
            state, loss = trainer.train_step(state, batch)
            loss = float(loss)  # waits for the step: honest step times
            dt = time.perf_counter() - t0
            elapsed += dt
            metrics["train_loss"].append(loss)
            metrics["step_time"].append(dt)
            done = step + 1
            if done % cfg.eval_every == 0 or done == cfg.steps:
                eval_loss = trainer.evaluate(state["params"], val)
                metrics["eval"].append({"step": done, "loss": eval_loss, "time": elapsed})
                if jax.process_index() == 0:  # tqdm.write prints on a disabled bar too
                    bar.write(
                        f"{cfg.norm} | step {done}: train {loss:.3f}  val {eval_loss:.3f} nats/byte"
                    )
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_step / dt:,.0f}")
            if done % cfg.checkpoint_every == 0 or done == cfg.steps:
                # Saved here, not by orbax's own policy: that one also saves the first
                # step of a run without a checkpoint (a stray step-1 checkpoint).
                manager.save(
                    done,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardSave(state),
                        metrics=ocp.args.JsonSave({k: metrics[k] for k in saved_metrics_keys}),
                    ),
                    force=True,
                )
    finally:  # on Ctrl-C too: the checkpoint being written is finished, not left half-done
        bar.close()
        manager.wait_until_finished()
        manager.close()
    metrics["steps_trained"] = cfg.steps - start
    metrics["final_eval_loss"] = metrics["eval"][-1]["loss"] if metrics["eval"] else None
    metrics["wall_time"] = elapsed
    if jax.process_index() == 0:  # one writer when the run spans several hosts
        files["metrics"].write_text(json.dumps(metrics, indent=1))
        plot_losses({cfg.norm: metrics}, files["plot"])
    return metrics


# ---------------------------------------------------------------- reporting


def plot_losses(runs: dict[str, dict], path: Path) -> None:
    """Train and validation loss against step, and validation loss against wall time."""
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone

    fig = Figure(figsize=(11, 4))
    by_step, by_time = fig.subplots(1, 2)
    for name, m in runs.items():
        steps = [e["step"] for e in m["eval"]]
        losses = [e["loss"] for e in m["eval"]]
        line = by_step.plot(steps, losses, "o-", label=f"{name} (val)")[0]
        if len(runs) == 1:
            by_step.plot(
                range(1, len(m["train_loss"]) + 1),
                m["train_loss"],
                alpha=0.4,
                color=line.get_color(),
                label=f"{name} (train)",
            )
        by_time.plot([e["time"] for e in m["eval"]], losses, "o-", label=name)
    first = next(iter(runs.values()))
    entropy = first["unigram_entropy"]
    corpus = first["config"]["data"] or "the pydoc topics corpus"
    for ax in (by_step, by_time):
        ax.axhline(entropy, color="gray", ls="--", label="unigram entropy")
        ax.set_ylabel("loss (nats/byte)")
        ax.legend()
    by_step.set_xlabel("step")
    by_time.set_xlabel("training wall time (s)")
    fig.suptitle(f"byte-level LM on {corpus}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def step_time_table(runs: dict[str, dict]) -> list[dict]:
    """Per norm of ``runs`` (metrics by norm, LayerNorm among them): the median step time
    after 5 warm-up steps, its quartiles, the ratio of medians to LayerNorm's with its
    spread (this norm's quartiles over LayerNorm's, the other way round), the final
    validation loss and the training time."""
    times = {}
    for norm, m in runs.items():
        steps = np.asarray(m["step_time"][5:] or m["step_time"])  # skip compile, warm-up
        times[norm] = 1e3 * np.percentile(steps, [25, 50, 75])
    q1_base, base, q3_base = times["layernorm"]
    return [
        {
            "norm": norm,
            "median_step_ms": float(median),
            "q1_step_ms": float(q1),
            "q3_step_ms": float(q3),
            "vs_layernorm": float(median / base),
            "vs_layernorm_low": float(q1 / q3_base),
            "vs_layernorm_high": float(q3 / q1_base),
            "final_val_loss": m["final_eval_loss"],
            "wall_time_s": m["wall_time"],
        }
        for (norm, m), (q1, median, q3) in zip(runs.items(), times.values(), strict=True)
    ]


def compare(
    cfg: Config, workdir: Path, resume: bool = False, overwrite: bool = False
) -> dict[str, dict]:
    """RMSNorm, pRMSNorm and LayerNorm with the same seed and data order, each in
    ``<workdir>/<norm>`` (``resume`` and ``overwrite`` as in ``train_and_evaluate``)."""
    workdir = Path(workdir)

    def check_all() -> None:  # refuse before training any of them
        for norm in NORMS:
            plan_run(dataclasses.replace(cfg, norm=norm), workdir / norm, resume, overwrite)

    decided_by_process_0(check_all)
    runs = {}
    for norm in NORMS:
        runs[norm] = train_and_evaluate(
            dataclasses.replace(cfg, norm=norm), workdir / norm, resume, overwrite
        )
    rows = step_time_table(runs)
    lines = [
        "| norm | median step (ms) | middle half of steps (ms) | vs LayerNorm (spread) "
        "| final val loss | wall (s) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['norm']} | {r['median_step_ms']:.1f} | {r['q1_step_ms']:.1f}-"
            f"{r['q3_step_ms']:.1f} | {r['vs_layernorm']:.3f} ({r['vs_layernorm_low']:.2f}-"
            f"{r['vs_layernorm_high']:.2f}) | {r['final_val_loss']:.3f} | "
            f"{r['wall_time_s']:.1f} |"
        )
    lines += [
        "",
        "Step times after 5 warm-up steps. The norms train one after the other, so a load "
        "that changes between them moves the ratio: the spread runs from the fast quarter "
        "of this norm's steps over LayerNorm's slow quarter to the slow quarter over the "
        "fast one; a spread that includes 1 shows no difference on this machine.",
    ]
    table = "\n".join(lines)
    if jax.process_index() == 0:
        print(table)
        (workdir / "compare.json").write_text(json.dumps(rows, indent=1))
        (workdir / "compare.md").write_text(table + "\n")
        plot_losses(runs, workdir / "compare.png")
    return runs


# ---------------------------------------------------------------- command line


def _mesh_arg(text: str) -> tuple[int, int]:
    try:
        data, model = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--mesh takes DATA,MODEL as two integers, e.g. 4,2; got {text!r}"
        ) from None
    if data < 1 or model < 1:
        raise argparse.ArgumentTypeError(f"--mesh sizes must be >= 1, got {text!r}")
    return data, model


def parse_args(argv: list[str] | None = None) -> tuple[Config, argparse.Namespace]:
    defaults = Config()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--norm", choices=NORMS, default=defaults.norm)
    parser.add_argument("--p", type=float, default=defaults.p, help="pRMSNorm fraction")
    parser.add_argument(
        "--steps",
        type=int,
        default=defaults.steps,
        help="train until this step (with --resume: may differ from the saved run's)",
    )
    parser.add_argument(
        "--schedule-steps",
        type=int,
        default=None,
        help="length of the learning-rate schedule (default: --steps; with --resume: the "
        "saved run's). Larger than --steps stops early on the schedule of a longer run, "
        "which --resume --steps N continues exactly",
    )
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len)
    parser.add_argument("--d-model", type=int, default=defaults.d_model)
    parser.add_argument("--num-heads", type=int, default=defaults.num_heads)
    parser.add_argument("--num-layers", type=int, default=defaults.num_layers)
    parser.add_argument("--learning-rate", type=float, default=defaults.learning_rate)
    parser.add_argument("--eval-every", type=int, default=defaults.eval_every)
    parser.add_argument("--checkpoint-every", type=int, default=defaults.checkpoint_every)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--mesh",
        type=_mesh_arg,
        default=None,
        help="DATA,MODEL device counts (default: all devices on data)",
    )
    parser.add_argument("--data", default=None, help="a UTF-8/bytes text file to train on")
    parser.add_argument("--workdir", default="runs/train_lm")
    existing = parser.add_mutually_exclusive_group()
    existing.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --workdir from its latest checkpoint; refused when the "
        "config differs from its config.json (except --steps, --eval-every, "
        "--checkpoint-every, --mesh, --no-progress)",
    )
    existing.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the run in --workdir (checkpoints, config.json, metrics.json, "
        "loss.png) and start afresh",
    )
    parser.add_argument(
        "--compare", action="store_true", help="train rmsnorm, prmsnorm and layernorm and compare"
    )
    launch = parser.add_argument_group(
        "several processes (multi-host; docs/multihost.md has the commands)",
        "Run the same command once per process, each with its own --process-id. Process 0 "
        "checks and writes --workdir (which every host must see: a shared filesystem) and "
        "prints; the others wait for it. Under SLURM, Open MPI or on a multi-host Cloud "
        "TPU, --distributed alone is enough: jax reads the rest from the launcher.",
    )
    launch.add_argument(
        "--distributed",
        action="store_true",
        help="call jax.distributed.initialize() (implied by any flag below, by "
        "JAX_COORDINATOR_ADDRESS, and by SLURM or Open MPI with several tasks)",
    )
    launch.add_argument(
        "--coordinator-address",
        metavar="HOST:PORT",
        default=None,
        help=f"process 0's host and a free port, the same on every process (default: "
        f"${DISTRIBUTED_ENV['coordinator_address']})",
    )
    launch.add_argument(
        "--num-processes",
        metavar="N",
        type=int,
        default=None,
        help=f"how many processes take part (default: ${DISTRIBUTED_ENV['num_processes']})",
    )
    launch.add_argument(
        "--process-id",
        metavar="I",
        type=int,
        default=None,
        help=f"this process, 0 to N-1 (default: ${DISTRIBUTED_ENV['process_id']})",
    )
    parser.add_argument(
        "--compile-for",
        metavar="TARGET",
        default=None,
        help="compile the sharded train step for TARGET (tpu-v5e:4x4, h100x8, ...; see "
        "rmsnorm_jax.aot) without a device, print per-device memory and the compiler's "
        "step estimate, and exit",
    )
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    positive = (
        "steps",
        "batch_size",
        "seq_len",
        "d_model",
        "num_heads",
        "num_layers",
        "eval_every",
        "checkpoint_every",
    )
    for name in positive:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.schedule_steps is not None and args.schedule_steps < 1:
        parser.error(f"--schedule-steps must be >= 1, got {args.schedule_steps}")
    if not 0 < args.p <= 1:
        parser.error(f"--p must be in (0, 1], got {args.p}")
    if args.learning_rate <= 0:
        parser.error(f"--learning-rate must be > 0, got {args.learning_rate}")
    if args.d_model % args.num_heads:
        parser.error(f"--d-model {args.d_model} must be divisible by --num-heads {args.num_heads}")
    cfg = Config(
        norm=args.norm,
        p=args.p,
        steps=args.steps,
        schedule_steps=args.schedule_steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        d_model=args.d_model,
        num_heads=args.num_heads,
        num_layers=args.num_layers,
        learning_rate=args.learning_rate,
        warmup_steps=None,  # a tenth of the schedule (on --resume: the saved run's)
        eval_every=args.eval_every,
        checkpoint_every=args.checkpoint_every,
        seed=args.seed,
        mesh=args.mesh,
        data=args.data,
        progress=not args.no_progress,
    )
    return cfg, args


def validate_for_devices(cfg: Config, devices: list | None = None) -> None:
    devices = jax.devices() if devices is None else devices
    data, model = cfg.mesh or (len(devices), 1)
    if data * model != len(devices):
        raise ValueError(
            f"--mesh {data},{model} needs {data * model} devices; this run has "
            f"{len(devices)} ({devices[0].device_kind})"
        )
    if cfg.batch_size % data:
        raise ValueError(f"--batch-size {cfg.batch_size} must be divisible by the data axis {data}")
    if cfg.num_heads % model:
        raise ValueError(f"--num-heads {cfg.num_heads} must be divisible by the model axis {model}")
    if (cfg.mlp_ratio * cfg.d_model) % model:
        raise ValueError(
            f"the MLP width {cfg.mlp_ratio * cfg.d_model} must be divisible by the model axis "
            f"{model}"
        )


def compile_for(cfg: Config, target_name: str) -> dict:
    """Compiles the sharded train step for ``target_name`` without running it.

    The real XLA:TPU or XLA:GPU compiler builds the program for the target's devices
    (``rmsnorm_jax.aot``); returns and prints the per-device memory (parameters and
    optimizer state, the batch, temporaries) and the compiler's own estimate of one
    step (a cost model, not a hardware timing; none for ``cpu`` and ``a100``).
    """
    from rmsnorm_jax import aot

    target = aot.get_target(target_name)
    devices = list(target.devices)
    validate_for_devices(cfg, devices)
    trainer = Trainer(cfg, devices)
    batch = jax.ShapeDtypeStruct(
        (cfg.batch_size, cfg.seq_len + 1), jnp.int32, sharding=trainer.batch_sharding
    )
    compiled = target.compile(trainer.train_step, trainer.abstract_state, batch)
    memory = compiled.memory_analysis()
    state_bytes = sum(
        math.prod(s.sharding.shard_shape(s.shape)) * s.dtype.itemsize
        for s in jax.tree.leaves(trainer.abstract_state)
    )
    report = {
        "target": target.name,
        "mesh": dict(trainer.mesh.shape),
        "state_bytes_per_device": state_bytes,
        "argument_bytes_per_device": memory.argument_size_in_bytes,
        "temp_bytes_per_device": memory.temp_size_in_bytes,
        "output_bytes_per_device": memory.output_size_in_bytes,
        "step_estimate": aot.estimate(compiled, target),
        "estimate_unit": target.estimate_unit,
    }
    mib = 2**20
    estimate = (
        f"no estimate (the compiler has no cost model for {target.name})"
        if report["step_estimate"] is None
        else f"{report['step_estimate']:,.0f} {target.estimate_unit} per step "
        f"(the compiler's cost model, not a hardware timing)"
    )
    print(
        f"{target.name}, mesh {report['mesh']}: per device "
        f"{state_bytes / mib:.1f} MiB parameters and optimizer state, "
        f"{memory.argument_size_in_bytes / mib:.1f} MiB arguments, "
        f"{memory.temp_size_in_bytes / mib:.1f} MiB temporaries; {estimate}"
    )
    return report


# Where --coordinator-address, --num-processes and --process-id are read from when not
# given. jax itself reads only the first; the other two are this example's (a launcher
# script sets them per process).
DISTRIBUTED_ENV = {
    "coordinator_address": "JAX_COORDINATOR_ADDRESS",
    "num_processes": "JAX_NUM_PROCESSES",
    "process_id": "JAX_PROCESS_ID",
}


def _cluster_launcher(env) -> str | None:
    """The launcher from which jax.distributed.initialize() reads the process count, id
    and coordinator by itself, or None."""
    if int(env.get("SLURM_NTASKS", "1")) > 1:
        return "SLURM"
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return "Open MPI"
    if "," in env.get("TPU_WORKER_HOSTNAMES", ""):
        return "a multi-host Cloud TPU"
    return None


def distributed_options(args: argparse.Namespace, env=os.environ) -> dict[str, Any] | None:
    """The keyword arguments of ``jax.distributed.initialize()`` for this command, or None
    for a single process; a ValueError names what is missing or wrong.

    Each of the coordinator's address, the process count and this process's id comes
    from its flag, else from its variable in ``DISTRIBUTED_ENV``. All three are needed
    unless a launcher that jax reads by itself (SLURM, Open MPI, a multi-host Cloud TPU)
    started the process.
    """
    given: dict[str, Any] = {}
    for name, variable in DISTRIBUTED_ENV.items():
        flag = "--" + name.replace("_", "-")
        value = getattr(args, name)
        if value is None and env.get(variable):
            value = env[variable]
            if name != "coordinator_address":
                try:
                    value = int(value)
                except ValueError:
                    raise ValueError(
                        f"{variable}={value!r} is not an integer; set it to {flag}'s value"
                    ) from None
        given[name] = value
    asked = args.distributed or any(value is not None for value in given.values())
    if not (asked or launched_as_several_processes(env)):
        return None
    launcher = _cluster_launcher(env)
    missing = [
        f"--{name.replace('_', '-')} (or {DISTRIBUTED_ENV[name]})"
        for name, value in given.items()
        if value is None
    ]
    if missing and launcher is None:
        raise ValueError(
            "several processes need the coordinator's address, the number of processes and "
            f"each one's id; missing {', '.join(missing)}. E.g. on two hosts: "
            "--coordinator-address HOST0:1234 --num-processes 2 --process-id 0 on the first "
            "and --process-id 1 on the second (docs/multihost.md); under SLURM, Open MPI or "
            "on a multi-host Cloud TPU --distributed alone is enough"
        )
    address = given["coordinator_address"]
    if address is not None:
        host, _, port = str(address).rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(
                f"--coordinator-address {address!r} is not HOST:PORT; give process 0's host "
                "and a free port, e.g. localhost:1234 or 10.0.0.1:1234"
            )
    count, index = given["num_processes"], given["process_id"]
    if count is not None and count < 1:
        raise ValueError(f"--num-processes must be >= 1, got {count}")
    if index is not None and not 0 <= index < (count if count is not None else index + 1):
        raise ValueError(
            f"--process-id {index} is outside 0..{count - 1 if count else '...'}: give each "
            "process its own id from 0 to --num-processes - 1"
        )
    return {name: value for name, value in given.items() if value is not None}


def launched_as_several_processes(env=os.environ) -> bool:
    """True under a multi-process launcher that jax.distributed.initialize() can read:
    an explicit coordinator, SLURM or Open MPI with several tasks, a multi-host TPU."""
    return (
        bool(env.get("JAX_COORDINATOR_ADDRESS"))
        or int(env.get("SLURM_NTASKS", "1")) > 1
        or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
        or "," in env.get("TPU_WORKER_HOSTNAMES", "")
    )


def _print_files(workdir: Path) -> None:
    """The closing lines: where the run's files are."""
    if jax.process_index() != 0:
        return
    files = run_files(workdir)
    steps = _steps_in_words(checkpoint_steps(workdir))
    print(f"checkpoints: {files['checkpoints']} ({steps}; --resume continues the latest)")
    print(f"config:      {files['config']}")
    print(f"metrics:     {files['metrics']}")
    print(f"plot:        {files['plot']}")


def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_args(argv)
    if args.compile_for:
        try:
            compile_for(cfg, args.compile_for)
        except (ValueError, RuntimeError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        return 0
    try:
        options = distributed_options(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if options is not None:
        jax.distributed.initialize(**options)
    try:
        validate_for_devices(cfg)
        load_corpus(cfg.data)  # fail fast on a missing or empty file
        workdir = Path(args.workdir)
        if args.compare:
            compare(cfg, workdir, resume=args.resume, overwrite=args.overwrite)
            for norm in NORMS:
                _print_files(workdir / norm)
            if jax.process_index() == 0:
                print(f"comparison:  {workdir / 'compare.md'}, {workdir / 'compare.json'}")
                print(f"plot:        {workdir / 'compare.png'}")
        else:
            m = train_and_evaluate(cfg, workdir, resume=args.resume, overwrite=args.overwrite)
            if m["steps_trained"] and jax.process_index() == 0:
                print(
                    f"final validation loss {m['final_eval_loss']:.3f} nats/byte "
                    f"(unigram entropy {m['unigram_entropy']:.3f}) at step {cfg.steps}, "
                    f"{m['wall_time']:.0f} s of training on {m['devices']} "
                    f"{m['platform']} device(s)"
                )
            _print_files(workdir)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
