"""Orbax checkpoints: a run's ``<workdir>/checkpoints``, saved, listed and restored.

Which workdir a command may use, and what it holds besides its checkpoints, is the
workdir's policy (``workdir.py``); this file knows only where orbax writes in a workdir
and how.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

# What a checkpoint holds besides the state: the metrics up to its step.
SAVED_METRICS = ("train_loss", "step_time", "eval")


def directory(workdir: str | Path) -> Path:
    """Where a run in ``workdir`` keeps its orbax checkpoints, one folder per step."""
    return Path(workdir) / "checkpoints"


def checkpoint_steps(workdir: str | Path) -> list[int]:
    """The steps of the complete checkpoints under ``<workdir>/checkpoints``, by orbax's own
    rule: a checkpoint that a killed run left half-written (a temporary directory, or no
    commit marker where the filesystem needs one) is neither counted nor restored."""
    path = directory(workdir)
    return sorted(ocp.utils.checkpoint_steps(path)) if path.is_dir() else []


def manager(workdir: Path) -> ocp.CheckpointManager:
    """Orbax's manager of ``<workdir>/checkpoints``, keeping the latest two. It writes a
    checkpoint into a temporary directory and renames it when every process has written
    its part: a run killed meanwhile leaves no checkpoint that ``checkpoint_steps`` or a
    restore would take."""
    return ocp.CheckpointManager(
        directory(workdir).absolute(),
        # No save policy: the train loop (train._train_loop) calls ``save`` when a save is due.
        options=ocp.CheckpointManagerOptions(max_to_keep=2),
    )


def save(checkpoints: ocp.CheckpointManager, step: int, state: Any, metrics: dict) -> None:
    """Starts writing ``state`` and the metrics so far as the checkpoint of ``step``."""
    checkpoints.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            metrics=ocp.args.JsonSave({k: metrics[k] for k in SAVED_METRICS}),
        ),
        force=True,
    )


def restore(
    checkpoints: ocp.CheckpointManager, step: int, abstract_state: Any = None
) -> tuple[Any, dict]:
    """``(state, metrics)`` of the checkpoint of ``step``; the state only when given its
    abstract form (shapes, dtypes and shardings), else None."""
    items: dict[str, Any] = {"metrics": ocp.args.JsonRestore()}
    if abstract_state is not None:
        items["state"] = ocp.args.StandardRestore(abstract_state)
    restored = checkpoints.restore(step, args=ocp.args.Composite(**items))
    state = restored["state"] if abstract_state is not None else None
    return state, {k: restored["metrics"][k] for k in SAVED_METRICS}
