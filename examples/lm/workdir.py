"""The workdir's policy: one run's files, and the checks that keep two runs from mixing.

A workdir holds one run: ``config.json``, ``checkpoints/`` (orbax, ``checkpoint.py``),
``metrics.json`` and ``loss.png`` (``run_files``). ``plan_run`` decides whether a command
may run there and with which config; ``prepare_workdir`` acts on that decision on process
0 alone.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from . import config as config_lib
from .checkpoint import checkpoint_steps
from .checkpoint import directory as checkpoint_directory
from .config import MAY_DIFFER_ON_RESUME, Config
from .distributed import decided_by_process_0


def run_files(workdir: str | Path) -> dict[str, Path]:
    """Where a run keeps its files in ``workdir``: what ``--overwrite`` removes."""
    workdir = Path(workdir)
    return {
        "checkpoints": checkpoint_directory(workdir),
        "config": workdir / "config.json",
        "metrics": workdir / "metrics.json",
        "plot": workdir / "loss.png",
    }


def newest_complete(workdirs: list[Path]) -> tuple[Path, Path | None]:
    """The workdir being trained (the last of ``workdirs`` that holds a config.json, else
    the first) and its newest complete checkpoint, or None when it has none yet."""
    started = [w for w in workdirs if run_files(w)["config"].exists()]
    workdir = started[-1] if started else workdirs[0]
    steps = checkpoint_steps(workdir)
    return workdir, run_files(workdir)["checkpoints"] / str(steps[-1]) if steps else None


def steps_in_words(steps: list[int]) -> str:
    """``[8, 12]`` as "steps 8, 12": the checkpoints' steps in a message."""
    return f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}"


def previous_run(workdir: Path) -> list[str]:
    """What ``workdir`` holds of an earlier run, in words; empty when nothing."""
    found = []
    for name, path in run_files(workdir).items():
        if name == "checkpoints":
            if path.is_dir() and any(path.iterdir()):
                steps = checkpoint_steps(workdir)
                found.append(
                    f"checkpoints at {steps_in_words(steps)}"
                    if steps
                    else "an unfinished checkpoint"
                )
        elif path.exists():
            found.append(path.name)
    return found


def against_saved(
    cfg: Config, saved: dict[str, Any], given: Collection[str] | None = None
) -> tuple[dict[str, Any], list[str]]:
    """The config to run as JSON, and the fields outside ``MAY_DIFFER_ON_RESUME`` in which it
    differs from ``saved``, in words.

    Fields not in ``given`` (the flags a command line gave) are the saved run's; with
    ``given`` None every field is given, except ``schedule_steps`` and ``warmup_steps``
    left None, which are the saved run's too.
    """
    requested = config_lib.to_json(cfg)
    for name in requested:
        unset = name in ("schedule_steps", "warmup_steps") and requested[name] is None
        if name in saved and (unset or (given is not None and name not in given)):
            requested[name] = saved[name]
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
    return isinstance(saved, dict) and not against_saved(cfg, saved)[1]


def plan_run(
    cfg: Config,
    workdir: str | Path,
    resume: bool,
    overwrite: bool,
    given: Collection[str] | None = None,
) -> Config:
    """The config that a run of ``cfg`` in ``workdir`` trains with, or a ValueError that
    says why it may not run there. Changes nothing on disk.

    A workdir that holds a run needs ``resume`` (continue it) or ``overwrite`` (start
    afresh), except where that run saved nothing and has this config (``_is_retry``: a
    start that failed before its first checkpoint; it starts again). On resume, the
    fields not in ``given`` (None: all are, see ``against_saved``) are the saved
    ``config.json``'s, and the given ones must equal it outside ``MAY_DIFFER_ON_RESUME``.
    """
    if resume and overwrite:
        raise ValueError("--resume and --overwrite exclude each other: pass one")
    workdir = Path(workdir)
    previous = previous_run(workdir)
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
        warmup, length = config_lib.schedule_of(cfg)
        return dataclasses.replace(cfg, warmup_steps=warmup, schedule_steps=length)
    requested, differing = against_saved(cfg, json.loads(config_file.read_text()), given)
    if differing:
        raise ValueError(
            f"--resume: this command's config differs from the run saved in {config_file} "
            f"in {'; '.join(differing)}. Only {', '.join(MAY_DIFFER_ON_RESUME)} may change "
            f"on resume: leave out the others (the saved run's are taken), or pass "
            f"--overwrite to start afresh"
        )
    return config_lib.from_json(requested)


def _remove_run(workdir: Path) -> None:
    """Deletes the run's files in ``workdir`` (``run_files``) for ``--overwrite``; other
    files there stay."""
    for path in run_files(workdir).values():
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def prepare_workdir(
    cfg: Config,
    workdir: Path,
    resume: bool,
    overwrite: bool,
    given: Collection[str] | None = None,
    check: Callable[[Config], None] = lambda cfg: None,
) -> tuple[Config, int | None]:
    """Checks ``workdir`` (``plan_run``) and the planned config (``check`` raises a
    ValueError when it cannot run here), prepares the workdir and says what it did:
    ``(the config to train, the checkpoint step to resume from or None)``. On process 0
    only (``decided_by_process_0``); nothing is changed when the run is refused or has
    nothing to train."""

    def decide() -> dict:
        previous = previous_run(workdir)
        planned = plan_run(cfg, workdir, resume, overwrite, given)
        check(planned)
        steps = checkpoint_steps(workdir) if resume else []
        latest = steps[-1] if steps else None
        if latest is not None and latest >= planned.steps:
            return {"config": config_lib.to_json(planned), "latest": latest}
        if overwrite and previous:
            _remove_run(workdir)
            print(f"--overwrite: removed the previous run in {workdir} ({', '.join(previous)})")
        elif previous and not resume:  # a retry (plan_run): nothing trained there
            print(
                f"{workdir} holds what a start of this command left before its first "
                f"checkpoint ({', '.join(previous)}): nothing was trained, starting from step 0"
            )
        workdir.mkdir(parents=True, exist_ok=True)
        text = json.dumps(config_lib.to_json(planned), indent=1) + "\n"
        run_files(workdir)["config"].write_text(text)
        sys.stdout.flush()
        return {"config": config_lib.to_json(planned), "latest": latest}

    decided = decided_by_process_0(decide)
    return config_lib.from_json(decided["config"]), decided["latest"]
