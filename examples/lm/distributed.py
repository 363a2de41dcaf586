"""Several processes (multi-host): the launch, and the decisions taken by process 0.

Every process runs the same program over one global mesh; process 0 alone checks and
writes the workdir and prints. A process that dies stops the others within seconds:
``lost_process.py`` (docs/multihost.md, "When a host is lost").
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

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


def launched_as_several_processes(env=os.environ) -> bool:
    """True under a multi-process launcher that jax.distributed.initialize() can read:
    an explicit coordinator, SLURM or Open MPI with several tasks, a multi-host TPU."""
    return bool(env.get("JAX_COORDINATOR_ADDRESS")) or _cluster_launcher(env) is not None


def _given_launch(args: argparse.Namespace, env) -> dict[str, Any]:
    """Each of the three launch values from its flag, else its variable, else None."""
    given: dict[str, Any] = {}
    for name, variable in DISTRIBUTED_ENV.items():
        value = getattr(args, name)
        if value is None and env.get(variable):
            value = env[variable]
            if name != "coordinator_address":
                try:
                    value = int(value)
                except ValueError:
                    flag = "--" + name.replace("_", "-")
                    raise ValueError(
                        f"{variable}={value!r} is not an integer; set it to {flag}'s value"
                    ) from None
        given[name] = value
    return given


def _check_launch(given: dict[str, Any]) -> None:
    """A ValueError for a coordinator that is not HOST:PORT or an id outside the count."""
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


def distributed_options(args: argparse.Namespace, env=os.environ) -> dict[str, Any] | None:
    """The keyword arguments of ``jax.distributed.initialize()`` for this command, or None
    for a single process; a ValueError names what is missing or wrong.

    Each of the coordinator's address, the process count and this process's id comes
    from its flag, else from its variable in ``DISTRIBUTED_ENV``. All three are needed
    unless a launcher that jax reads by itself (SLURM, Open MPI, a multi-host Cloud TPU)
    started the process.
    """
    given = _given_launch(args, env)
    asked = args.distributed or any(value is not None for value in given.values())
    if not (asked or launched_as_several_processes(env)):
        return None
    missing = [
        f"--{name.replace('_', '-')} (or {DISTRIBUTED_ENV[name]})"
        for name, value in given.items()
        if value is None
    ]
    if missing and _cluster_launcher(env) is None:
        raise ValueError(
            "several processes need the coordinator's address, the number of processes and "
            f"each one's id; missing {', '.join(missing)}. E.g. on two hosts: "
            "--coordinator-address HOST0:1234 --num-processes 2 --process-id 0 on the first "
            "and --process-id 1 on the second (docs/multihost.md); under SLURM, Open MPI or "
            "on a multi-host Cloud TPU --distributed alone is enough"
        )
    _check_launch(given)
    return {name: value for name, value in given.items() if value is not None}


def say(text: str) -> None:
    """Prints ``text`` on process 0 (the others stay quiet)."""
    if jax.process_index() == 0:
        print(text, flush=True)


class Refused(ValueError):
    """A refusal that process 0 decided and every process raises alike."""


def decided_by_process_0(decide: Callable[[], Any]) -> Any:
    """``decide()`` run on process 0 alone, and its answer (anything JSON can hold) given
    to every process; a ``ValueError`` it raises is raised on every process (as
    ``Refused``).

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
        raise Refused(received["error"])
    return received["answer"]


# jax's own checks of the other processes, shortened. jax's heartbeat ends the survivors of
# a lost process with an abort and a C++ stack HEARTBEAT_TIMEOUT_S after the loss (jax's
# default: 100 s), so lost_process.py's watch must decide well before (it does after its
# LOST_AFTER_S, 10 s); SHUTDOWN_TIMEOUT_S bounds jax's wait for every process at exit
# (jax's default: 300 s).
HEARTBEAT_TIMEOUT_S = 30
SHUTDOWN_TIMEOUT_S = 30


def initialize(options: dict[str, Any]) -> None:
    """``jax.distributed.initialize(**options)`` with this example's timeouts."""
    jax.distributed.initialize(
        **options,
        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
        shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S,
    )
