"""A lost process: found within seconds, the others stopped, and the command to go on.

A process that dies (killed, preempted, its host gone) cannot say so. Every process of a
run beats on jax's coordination service and reads the others' beats; when one stands
still, the others stop with exit code ``EXIT_LOST`` and four lines on stderr: which process
was lost, the newest complete checkpoint, and the ``--resume`` command that continues
from it (docs/multihost.md, "When a host is lost"). The command line calls ``watched``
alone; everything else here serves it.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import os
import shlex
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

import jax

from .config import NORMS
from .distributed import DISTRIBUTED_ENV, Refused
from .workdir import newest_complete

# Each process writes a counter to jax's coordination service every TICK_S; a process
# whose counter has not moved for LOST_AFTER_S is lost, and the others stop with
# EXIT_LOST, well before jax's own heartbeat would abort them with a C++ stack
# (distributed.HEARTBEAT_TIMEOUT_S after the loss).
TICK_S = 1.0
LOST_AFTER_S = 10.0
EXIT_LOST = 75  # EX_TEMPFAIL: a temporary failure; run again (with --resume)
_ALIVE = "train_lm/alive/"

# After an error, once the watch has found a lost process, the main thread sleeps this
# long while the watch prints the stop and ends the process (``os._exit``: milliseconds,
# or a listing of the checkpoints on a slow shared filesystem), so that it neither
# reports the error (a traceback) nor starts jax's exit (which waits for the lost process,
# then aborts). The sleep is not meant to run out: 60 s outlasts jax's heartbeat timeout
# (distributed.HEARTBEAT_TIMEOUT_S, 30 s after the loss), which ends the process should
# the watch itself hang.
STOP_GRACE_S = 60


class Watch:
    """The watch of the other processes: ``lost`` is set once it has found a lost process
    (it then prints the stop and ends this process), ``done`` stops it."""

    def __init__(self) -> None:
        self.lost = threading.Event()
        self.done = threading.Event()


def _client():
    """jax's client of the coordination service (the one orbax and multihost_utils use),
    or None on one process (jax.distributed not initialized) or when this jax has none
    where expected."""
    from jax._src import distributed as jax_distributed

    return getattr(getattr(jax_distributed, "global_state", None), "client", None)


def _watch(client, watch: Watch, on_lost: Callable[[list[int]], NoReturn]) -> None:
    """The watch's thread: beats, reads every process's beat, calls ``on_lost`` with the
    processes whose beat stood still for ``LOST_AFTER_S``."""
    me, count = jax.process_index(), jax.process_count()
    others = [i for i in range(count) if i != me]
    last = {i: (None, time.monotonic()) for i in others}  # beat, when it last moved
    beat = 0
    while not watch.done.wait(TICK_S):
        beat += 1
        try:
            client.key_value_set(f"{_ALIVE}{me}", str(beat), allow_overwrite=True)
            beats = dict(client.key_value_dir_get(_ALIVE))
        except Exception:  # the coordination service itself is gone: process 0 is lost
            lost = [0]
        else:
            now = time.monotonic()
            for i in others:
                seen = beats.get(f"{_ALIVE}{i}")
                if seen != last[i][0]:
                    last[i] = (seen, now)
            lost = [i for i in others if now - last[i][1] > LOST_AFTER_S]
        if lost and not watch.done.is_set():
            watch.lost.set()
            on_lost(lost)


def _start(on_lost: Callable[[list[int]], NoReturn]) -> Watch | None:
    """Starts watching the other processes of this run in a thread; ``on_lost(ids)`` is
    called there when some are lost (and must end this process). None on one process."""
    client = _client()
    if client is None or jax.process_count() == 1:
        return None
    watch = Watch()
    # Before jax's exit (atexit runs the last registered first): a process that ends for
    # another reason stops beating, and its client may close under a beat.
    atexit.register(watch.done.set)
    thread = threading.Thread(
        target=_watch, args=(client, watch, on_lost), name="lost-process-watch", daemon=True
    )
    thread.start()
    return watch


def _as_typed(path: str) -> str:
    """``path`` relative to the working directory when it lies below it."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def resume_command(args: argparse.Namespace, script: str) -> list[str]:
    """The command that continues this run from its newest complete checkpoint on this
    process (``script`` is the command line's file): ``--resume`` takes every Config flag
    from the run's config.json, so only where the run is and how it is launched are given."""
    command = [_as_typed(sys.executable), _as_typed(script), "--resume"]
    command += ["--workdir", args.workdir, *(["--compare"] if args.compare else [])]
    command += ["--distributed"] if args.distributed else []
    for name in DISTRIBUTED_ENV:
        if getattr(args, name) is not None:
            command += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return command


def stop_message(lost: list[int], args: argparse.Namespace, script: str) -> list[str]:
    """The four lines of the stop: which process was lost, the newest complete checkpoint
    (of the norm being trained, on ``--compare``) and how to go on."""
    lost_ones = f"process {lost[0]}" if len(lost) == 1 else f"processes {lost}"
    workdirs = [Path(args.workdir)]
    if args.compare:
        workdirs = [Path(args.workdir) / norm for norm in NORMS]
    workdir, newest = newest_complete(workdirs)
    each = " (each with its own --process-id)" if args.process_id is not None else ""
    return [
        f"error: lost {lost_ones} of {jax.process_count()}: no sign of life on jax's "
        f"coordination service for {LOST_AFTER_S:.0f} s. Process {jax.process_index()} stops.",
        f"newest complete checkpoint: {newest}"
        if newest
        else f"no complete checkpoint in {workdir} yet: --resume starts from step 0",
        f"to go on, start every process again with --resume{each}; this one:",
        "  " + shlex.join(resume_command(args, script)),
    ]


def _stop(lines: list[str]) -> NoReturn:
    """Prints ``lines`` to stderr and ends this process at once with ``EXIT_LOST``:
    ``os._exit``, so that neither Python's exit nor jax's (a shutdown barrier that the
    lost process never reaches, then an abort) runs."""
    print("\n".join(lines), file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_LOST)


def _stop_lost(lost: list[int], args: argparse.Namespace, script: str) -> NoReturn:
    """The watch's ``on_lost``: the stop, with its message."""
    _stop(stop_message(lost, args, script))


def _wait_for_the_watch(watch: Watch | None) -> None:
    """After an error on a run of several processes: gives the watch the time to find a
    lost process (it then stops this one) before the error is reported."""
    if watch is not None and not watch.done.is_set():
        if watch.lost.wait(LOST_AFTER_S + 10 * TICK_S):
            time.sleep(STOP_GRACE_S)


def _finish(watch: Watch | None) -> None:
    """The end of a run: every process here (a barrier), then the watch stops; so no
    process takes another that has finished for a lost one."""
    if watch is not None:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("train_lm: finished")
        watch.done.set()


@contextlib.contextmanager
def watched(args: argparse.Namespace, script: str) -> Iterator[None]:
    """Runs the body while the other processes of this run are watched (on one process:
    just runs it). A lost process stops this one within seconds (``stop_message``, exit
    code ``EXIT_LOST``), also while the body waits in a collective that will never end.

    An error in the body first waits for the watch's verdict: on a loss the survivors'
    collectives fail too (on CPU, Gloo's "Connection reset by peer"), and the stop says
    more than that error. A refusal (``Refused``: decided by process 0, the same on every
    process) is no such symptom and does not wait. At the end, every process meets the
    others before the watch stops (``_finish``).
    """
    watch = _start(functools.partial(_stop_lost, args=args, script=script))
    try:
        yield
        _finish(watch)
    except Refused:
        raise
    except Exception:
        _wait_for_the_watch(watch)
        raise
