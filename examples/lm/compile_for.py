"""``--compile-for``: the sharded train step compiled for a pod or a GPU node, deviceless."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .config import Config
from .train import Trainer, validate_for_devices


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
    print(_in_words(report))
    return report


def _in_words(report: dict) -> str:
    mib = 2**20
    estimate = (
        f"no estimate (the compiler has no cost model for {report['target']})"
        if report["step_estimate"] is None
        else f"{report['step_estimate']:,.0f} {report['estimate_unit']} per step "
        f"(the compiler's cost model, not a hardware timing)"
    )
    return (
        f"{report['target']}, mesh {report['mesh']}: per device "
        f"{report['state_bytes_per_device'] / mib:.1f} MiB parameters and optimizer state, "
        f"{report['argument_bytes_per_device'] / mib:.1f} MiB arguments, "
        f"{report['temp_bytes_per_device'] / mib:.1f} MiB temporaries; {estimate}"
    )
