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
holds a run is refused unless ``--resume`` continues it (with its config.json's values for
the flags not given; see ``lm.config.MAY_DIFFER_ON_RESUME`` for those that may differ) or
``--overwrite`` deletes it first: two runs never mix. On several processes, a lost process
stops the others within seconds, naming the checkpoint and the ``--resume`` command
(docs/multihost.md).

This file is the command line; the parts are in ``lm/``: ``config.py`` (the run's
Config), ``data.py`` (the input pipeline), ``model.py``, ``train.py`` (the train step and
``train_and_evaluate``), ``workdir.py`` (the workdir's files and checks),
``checkpoint.py`` (orbax), ``distributed.py`` (the launch of several processes),
``lost_process.py`` (a lost process: the stop and the ``--resume`` command),
``report.py`` (plots, the comparison) and ``compile_for.py``.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from pathlib import Path

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

# The package lm/ beside this file, also when this file is loaded from elsewhere (the
# tests, the notebook, reproduce.py).
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax
from lm import distributed, lost_process, train
from lm.checkpoint import checkpoint_steps
from lm.config import NORMS, Config
from lm.workdir import run_files, steps_in_words


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


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that set the run's Config (saved in its config.json). Each defaults to
    None, "not given": Config's default for a new run, the saved run's on --resume."""
    defaults = Config()
    parser.add_argument("--norm", choices=NORMS, help=f"default {defaults.norm}")
    parser.add_argument("--p", type=float, help=f"pRMSNorm fraction (default {defaults.p})")
    parser.add_argument(
        "--steps", type=int, help=f"train until this step (default {defaults.steps})"
    )
    parser.add_argument(
        "--schedule-steps",
        type=int,
        help="length of the learning-rate schedule (default: --steps). Larger than --steps "
        "stops early on the schedule of a longer run, which --resume --steps N continues "
        "exactly",
    )
    for name in ("batch_size", "seq_len", "d_model", "num_heads", "num_layers"):
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=int, help=f"default {getattr(defaults, name)}")
    parser.add_argument("--learning-rate", type=float, help=f"default {defaults.learning_rate}")
    parser.add_argument("--eval-every", type=int, help=f"default {defaults.eval_every}")
    parser.add_argument("--checkpoint-every", type=int, help=f"default {defaults.checkpoint_every}")
    parser.add_argument("--seed", type=int, help=f"default {defaults.seed}")
    parser.add_argument(
        "--mesh", type=_mesh_arg, help="DATA,MODEL device counts (default: all devices on data)"
    )
    parser.add_argument("--data", help="a UTF-8/bytes text file to train on")


def _add_run_flags(parser: argparse.ArgumentParser) -> None:
    """Where the run goes and what it does there."""
    parser.add_argument("--workdir", default="runs/train_lm")
    existing = parser.add_mutually_exclusive_group()
    existing.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --workdir from its latest checkpoint, with its "
        "config.json's values for the flags not given; refused when a flag given differs "
        "from them (except --steps, --eval-every, --checkpoint-every, --mesh, --no-progress)",
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


def _add_launch_flags(parser: argparse.ArgumentParser) -> None:
    """Several processes (docs/multihost.md)."""
    env = distributed.DISTRIBUTED_ENV
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
        f"${env['coordinator_address']})",
    )
    launch.add_argument(
        "--num-processes",
        metavar="N",
        type=int,
        default=None,
        help=f"how many processes take part (default: ${env['num_processes']})",
    )
    launch.add_argument(
        "--process-id",
        metavar="I",
        type=int,
        default=None,
        help=f"this process, 0 to N-1 (default: ${env['process_id']})",
    )


# The flags that set a Config field of the same name (--no-progress sets ``progress``), and
# those of them that must be >= 1.
CONFIG_FLAGS = tuple(
    "norm p steps schedule_steps batch_size seq_len d_model num_heads num_layers "
    "learning_rate eval_every checkpoint_every seed mesh data".split()
)
POSITIVE = tuple(
    "steps schedule_steps batch_size seq_len d_model num_heads num_layers eval_every "
    "checkpoint_every".split()
)


def _check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, cfg: Config) -> None:
    """``parser.error`` (exit 2) for a value no run can take."""
    for name in POSITIVE:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.p is not None and not 0 < args.p <= 1:
        parser.error(f"--p must be in (0, 1], got {args.p}")
    if args.learning_rate is not None and args.learning_rate <= 0:
        parser.error(f"--learning-rate must be > 0, got {args.learning_rate}")
    if not args.resume and cfg.d_model % cfg.num_heads:  # on --resume: the saved run's
        parser.error(f"--d-model {cfg.d_model} must be divisible by --num-heads {cfg.num_heads}")


def parse_args(argv: list[str] | None = None) -> tuple[Config, argparse.Namespace]:
    """The command line's Config (Config's defaults for the flags not given), and all its
    flags; ``args.given`` names the Config fields that the command line gave."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _add_config_flags(parser)
    _add_run_flags(parser)
    _add_launch_flags(parser)
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
    given = {name: getattr(args, name) for name in CONFIG_FLAGS if getattr(args, name) is not None}
    if args.no_progress:
        given["progress"] = False
    args.given = tuple(given)
    # warmup_steps None: a tenth of the schedule (on --resume: the saved run's).
    cfg = Config(**{"warmup_steps": None, **given})
    _check_flags(parser, args, cfg)
    return cfg, args


def _print_files(workdir: Path) -> None:
    """The closing lines: where the run's files are."""
    if jax.process_index() != 0:
        return
    files = run_files(workdir)
    steps = steps_in_words(checkpoint_steps(workdir))
    print(f"checkpoints: {files['checkpoints']} ({steps}; --resume continues the latest)")
    print(f"config:      {files['config']}")
    print(f"metrics:     {files['metrics']}")
    print(f"plot:        {files['plot']}")


def run(cfg: Config, args: argparse.Namespace) -> None:
    """Trains (``--compare``: the three norms) as the command line says, and prints where
    the files are."""
    workdir = Path(args.workdir)
    how = {"resume": args.resume, "overwrite": args.overwrite, "given": args.given}
    if args.compare:
        train.compare(cfg, workdir, **how)
        for norm in NORMS:
            _print_files(workdir / norm)
        distributed.say(f"comparison:  {workdir / 'compare.md'}, {workdir / 'compare.json'}")
        distributed.say(f"plot:        {workdir / 'compare.png'}")
        return
    m = train.train_and_evaluate(cfg, workdir, **how)
    if m["steps_trained"]:
        distributed.say(
            f"final validation loss {m['final_eval_loss']:.3f} nats/byte "
            f"(unigram entropy {m['unigram_entropy']:.3f}) at step {m['config']['steps']}, "
            f"{m['wall_time']:.0f} s of training on {m['devices']} "
            f"{m['platform']} device(s)"
        )
    _print_files(workdir)


def main(argv: list[str] | None = None) -> int:
    """The command: exit code 0, or 2 and a message for a command that cannot run (a lost
    process ends this one meanwhile with ``lost_process.EXIT_LOST``)."""
    cfg, args = parse_args(argv)
    try:
        if args.compile_for:
            from lm.compile_for import compile_for

            compile_for(cfg, args.compile_for)
            return 0
        options = distributed.distributed_options(args)
    except (ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if options is not None:
        distributed.initialize(options)
    try:
        # On several processes, a lost one stops this one: lm/lost_process.py.
        with lost_process.watched(args, script=__file__):
            run(cfg, args)
    except ValueError as err:  # a refusal, or a value this run cannot take
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
