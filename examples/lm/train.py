"""The training loop: the mesh, the optimizer, a pure jitted train step, and
``train_and_evaluate(cfg, workdir)``, which trains one run in its workdir."""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import checkpoint, data, report
from .config import NORMS, Config, schedule_of
from .distributed import decided_by_process_0, say
from .model import LOGICAL_RULES, TransformerLM
from .workdir import plan_run, prepare_workdir, run_files


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


def validate_for_devices(cfg: Config, devices: list | None = None) -> None:
    """A ValueError when ``cfg``'s mesh does not fit ``devices`` (default: this run's)."""
    devices = jax.devices() if devices is None else devices
    data_axis, model_axis = cfg.mesh or (len(devices), 1)
    if data_axis * model_axis != len(devices):
        raise ValueError(
            f"--mesh {data_axis},{model_axis} needs {data_axis * model_axis} devices; this "
            f"run has {len(devices)} ({devices[0].device_kind})"
        )
    if cfg.batch_size % data_axis:
        raise ValueError(
            f"--batch-size {cfg.batch_size} must be divisible by the data axis {data_axis}"
        )
    if cfg.num_heads % model_axis:
        raise ValueError(
            f"--num-heads {cfg.num_heads} must be divisible by the model axis {model_axis}"
        )
    if (cfg.mlp_ratio * cfg.d_model) % model_axis:
        raise ValueError(
            f"the MLP width {cfg.mlp_ratio * cfg.d_model} must be divisible by the model axis "
            f"{model_axis}"
        )


def check_runnable(cfg: Config) -> None:
    """A ValueError when ``cfg`` cannot run here: its mesh, or a missing or empty corpus."""
    validate_for_devices(cfg)
    data.load_corpus(cfg.data)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """AdamW after clipping, on a linear warmup and a cosine decay to a tenth."""
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
    """Mean next-byte cross-entropy of ``batch`` (``seq_len + 1`` bytes a row)."""
    logits = model.apply({"params": params}, batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def init_state(
    key: jax.Array, model: nn.Module, optimizer: optax.GradientTransformation, batch_shape
) -> dict:
    """Parameters and optimizer state, boxed with their logical axis names (Adam's moments,
    made by tree-mapping over the parameters, carry the same names)."""
    params = model.init(key, jnp.zeros(batch_shape, jnp.int32))["params"]
    return {"params": params, "opt_state": optimizer.init(params)}


def train_step(
    state: dict, batch: jax.Array, model: nn.Module, optimizer: optax.GradientTransformation
) -> tuple[dict, jax.Array]:
    """One optimizer step on ``batch``: the new state and the batch's loss before it."""
    with nn.logical_axis_rules(LOGICAL_RULES):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], model, batch)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {"params": params, "opt_state": opt_state}, loss


def eval_step(params: Any, batch: jax.Array, model: nn.Module) -> jax.Array:
    with nn.logical_axis_rules(LOGICAL_RULES):
        return loss_fn(params, model, batch)


class Trainer:
    """One configuration's model and optimizer, its state's shardings on the mesh, and
    ``init``, ``train_step`` and ``eval_step`` jitted with them."""

    def __init__(self, cfg: Config, devices: list | None = None):
        self.cfg = cfg
        self.mesh = make_mesh(cfg, devices)
        self.model = TransformerLM(cfg)
        self.optimizer = make_optimizer(cfg)
        init_boxed = functools.partial(
            init_state,
            model=self.model,
            optimizer=self.optimizer,
            batch_shape=(cfg.batch_size, cfg.seq_len),
        )
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
        self.init = jax.jit(
            lambda key: nn.meta.unbox(init_boxed(key)), out_shardings=self.state_shardings
        )
        self.train_step = jax.jit(
            functools.partial(train_step, model=self.model, optimizer=self.optimizer),
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, replicated),
            donate_argnums=0,
        )
        self.eval_step = jax.jit(
            functools.partial(eval_step, model=self.model),
            in_shardings=(self.state_shardings["params"], self.batch_sharding),
            out_shardings=replicated,
        )

    def put_batch(self, batch: np.ndarray) -> jax.Array:
        """A global batch on the mesh; every process builds the same batch, so this also
        works when the run spans several hosts."""
        return jax.make_array_from_callback(batch.shape, self.batch_sharding, lambda i: batch[i])

    def evaluate(self, params, batches: list[np.ndarray]) -> float:
        return float(np.mean([self.eval_step(params, self.put_batch(b)) for b in batches]))


def _new_metrics(cfg: Config, train_tokens: np.ndarray) -> dict[str, Any]:
    return {
        "config": dataclasses.asdict(cfg),
        "devices": jax.device_count(),
        "platform": jax.devices()[0].platform,
        "mesh": None,
        "unigram_entropy": data.unigram_entropy(train_tokens),
        "train_loss": [],
        "step_time": [],
        "eval": [],
        "resumed_from": None,
        "steps_trained": 0,
    }


def _nothing_to_train(cfg: Config, workdir: Path, latest: int, metrics: dict) -> dict:
    """The metrics of a run already at or past ``cfg.steps``; says so, changes no file."""
    checkpoints = checkpoint.manager(workdir)
    _, saved = checkpoint.restore(checkpoints, latest)
    checkpoints.close()
    metrics.update(saved, mesh=dict(make_mesh(cfg).shape), resumed_from=latest)
    metrics["final_eval_loss"] = metrics["eval"][-1]["loss"] if metrics["eval"] else None
    metrics["wall_time"] = sum(metrics["step_time"])
    say(
        f"nothing to train: the run in {workdir} is at step {latest} and --steps is "
        f"{cfg.steps}; pass a larger --steps to train on (no file was changed)"
    )
    return metrics


def _restore_or_init(
    cfg: Config, trainer: Trainer, checkpoints, latest: int | None, resume: bool, workdir: Path
) -> tuple[dict, dict | None]:
    """The state to start from, and the metrics saved with it (None when from step 0)."""
    files = run_files(workdir)
    if latest is None:
        if resume:
            say(f"--resume: no checkpoint in {files['checkpoints']} yet; training from step 0")
        return trainer.init(jax.random.key(cfg.seed)), None
    state, saved = checkpoint.restore(checkpoints, latest, trainer.abstract_state)
    say(f"resumed from step {latest} of {files['checkpoints']}, training to step {cfg.steps}")
    return state, saved


def _train_loop(cfg, trainer, state, start, train_tokens, val, checkpoints, metrics) -> float:
    """Steps ``start`` to ``cfg.steps``: evaluates and saves when due, records the losses
    and step times in ``metrics``; returns the time spent in train steps in all."""
    from tqdm import tqdm

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
            batch = trainer.put_batch(data.batch_at(train_tokens, step, cfg, cfg.seed))
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
                checkpoint.save(checkpoints, done, state, metrics)
    finally:
        bar.close()
    return elapsed


def train_and_evaluate(
    cfg: Config,
    workdir: str | Path,
    resume: bool = False,
    overwrite: bool = False,
    given: Collection[str] | None = None,
) -> dict:
    """Trains ``cfg`` and writes config, checkpoints, metrics and plot under ``workdir``.

    A workdir that already holds a run is refused unless ``resume`` (continue from its
    latest checkpoint, printing "resumed from step N"; the config must match, see
    ``plan_run`` in workdir.py, where ``given`` is explained) or ``overwrite`` (remove the
    old run's files, ``run_files``, and start afresh). Resuming a run already at
    ``cfg.steps`` or beyond trains nothing, says so, and changes no file.

    Returns the metrics dict (also written to ``<workdir>/metrics.json``); its
    ``steps_trained`` is the number of steps this call trained.
    """
    workdir = Path(workdir)
    cfg, latest = prepare_workdir(cfg, workdir, resume, overwrite, given, check=check_runnable)
    train_tokens, val_tokens = data.split_tokens(data.load_corpus(cfg.data), cfg)
    metrics = _new_metrics(cfg, train_tokens)
    if latest is not None and latest >= cfg.steps:
        return _nothing_to_train(cfg, workdir, latest, metrics)

    val = data.eval_batches(val_tokens, cfg)
    trainer = Trainer(cfg)
    metrics["mesh"] = dict(trainer.mesh.shape)
    checkpoints = checkpoint.manager(workdir)
    start = latest or 0
    try:
        state, saved = _restore_or_init(cfg, trainer, checkpoints, latest, resume, workdir)
        if saved is not None:
            metrics.update(saved, resumed_from=latest)
        elapsed = _train_loop(cfg, trainer, state, start, train_tokens, val, checkpoints, metrics)
    finally:  # on Ctrl-C too: the checkpoint being written is finished, not left half-done
        checkpoints.wait_until_finished()
        checkpoints.close()
    metrics["steps_trained"] = cfg.steps - start
    metrics["final_eval_loss"] = metrics["eval"][-1]["loss"] if metrics["eval"] else None
    metrics["wall_time"] = elapsed
    if jax.process_index() == 0:  # one writer when the run spans several hosts
        files = run_files(workdir)
        files["metrics"].write_text(json.dumps(metrics, indent=1))
        report.plot_losses({cfg.norm: metrics}, files["plot"])
    return metrics


def compare(
    cfg: Config, workdir: Path, resume: bool = False, overwrite: bool = False, given=None
) -> dict[str, dict]:
    """RMSNorm, pRMSNorm and LayerNorm with the same seed and data order, each in
    ``<workdir>/<norm>`` (``resume``, ``overwrite`` and ``given`` as in
    ``train_and_evaluate``); prints and writes the step-time table and the plot."""
    workdir = Path(workdir)

    def check_all() -> None:  # refuse before training any of them
        for norm in NORMS:
            norm_cfg = dataclasses.replace(cfg, norm=norm)
            plan_run(norm_cfg, workdir / norm, resume, overwrite, given)

    decided_by_process_0(check_all)
    runs = {
        norm: train_and_evaluate(
            dataclasses.replace(cfg, norm=norm), workdir / norm, resume, overwrite, given
        )
        for norm in NORMS
    }
    if jax.process_index() == 0:
        report.write_comparison(runs, workdir)
    return runs
