"""The run's configuration: what defines a run, and what a resumed run may change."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

NORMS = ("rmsnorm", "prmsnorm", "layernorm")


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


def to_json(cfg: Config) -> dict[str, Any]:
    """``cfg`` as ``config.json`` holds it (tuples as lists)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def from_json(saved: dict[str, Any]) -> Config:
    """The Config of a ``config.json`` (fields this version does not know are dropped)."""
    known = {f.name for f in dataclasses.fields(Config)}
    values = {k: v for k, v in saved.items() if k in known}
    if values.get("mesh") is not None:
        values["mesh"] = tuple(values["mesh"])
    return Config(**values)
