"""The example as several processes on this machine (docs/multihost.md): two CPU processes
train as one process with two devices, and when one is killed the other stops within
seconds, saying what to run, and the run resumes to the uninterrupted run's losses.
"""

import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_lm.py"

# The tiny model of tests/example/test_train_lm.py: 1 layer of d=32, a batch of 8 x 32 bytes.
TINY = [
    "--batch-size=8",
    "--seq-len=32",
    "--d-model=32",
    "--num-heads=2",
    "--num-layers=1",
    "--learning-rate=1e-2",
    "--eval-every=4",
    "--checkpoint-every=4",
    "--no-progress",
]
# The same run computed alike (tests/example/test_train_lm.py's SAME_RUN): XLA:CPU is bitwise
# reproducible for one program on the same inputs.
SAME_RUN = 1e-6


@pytest.fixture(scope="module")
def lm():
    """The example's package, examples/lm/ (train_lm.py puts examples/ on sys.path)."""
    spec = importlib.util.spec_from_file_location("train_lm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_lm"] = module
    spec.loader.exec_module(module)
    import lm

    return lm


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


# One process of the example with a given number of CPU devices (the test process has
# eight: conftest.py) and no accelerator.
def _example_env(devices: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    return {
        **env,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
    }


def _metrics(workdir: Path) -> dict:
    return json.loads((workdir / "metrics.json").read_text())


def _start(command: list[str], devices: int, log: Path) -> subprocess.Popen:
    """The command in the background, its stdout and stderr to ``log`` (.out, .err)."""
    with log.with_suffix(".out").open("w") as out, log.with_suffix(".err").open("w") as err:
        return subprocess.Popen(command, env=_example_env(devices), stdout=out, stderr=err)


def _finished(process: subprocess.Popen, log: Path, timeout: float = 600) -> tuple[str, str]:
    process.wait(timeout=timeout)
    return log.with_suffix(".out").read_text(), log.with_suffix(".err").read_text()


def _launch(argv: list[str], port: int) -> list[list[str]]:
    """The two processes' commands of ``python examples/train_lm.py ARGV``."""
    launch = ["--coordinator-address", f"localhost:{port}", "--num-processes", "2"]
    command = [sys.executable, str(EXAMPLE), *argv, *launch]
    return [[*command, "--process-id", str(i)] for i in (0, 1)]


def test_two_processes_train_as_one_process_with_two_devices(lm, tmp_path):
    """The launch of docs/multihost.md on one machine: two processes started together
    (the issue saw 4 of 6 such launches race on the workdir), one writer and one printer,
    and the run of one process with two devices, bit for bit."""
    workdir, reference = tmp_path / "two", tmp_path / "one"
    argv = [*TINY, "--steps=12"]
    commands = _launch([*argv, "--workdir", str(workdir)], _free_port())
    processes = [_start(c, 1, tmp_path / f"p{i}") for i, c in enumerate(commands)]
    single = _start(
        [sys.executable, str(EXAMPLE), *argv, "--workdir", str(reference)], 2, tmp_path / "one"
    )
    logs = [tmp_path / "p0", tmp_path / "p1", tmp_path / "one"]
    outputs = [_finished(p, log) for p, log in zip((*processes, single), logs, strict=True)]
    for p, (_, err) in zip((*processes, single), outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    (first, _), (second, _), (alone, _) = outputs
    assert "rmsnorm | step 12: train" in first and f"config:      {workdir}" in first
    assert "nats/byte" not in second and str(workdir) not in second  # process 1 is quiet
    assert sorted(p.name for p in workdir.iterdir()) == sorted(
        ["checkpoints", "config.json", "metrics.json", "loss.png"]
    )
    assert lm.checkpoint.checkpoint_steps(workdir) == [8, 12]
    two, one = _metrics(workdir), _metrics(reference)
    assert (two["devices"], two["mesh"]) == (2, {"data": 2, "model": 1})
    assert (one["devices"], one["mesh"]) == (2, {"data": 2, "model": 1})
    np.testing.assert_allclose(two["train_loss"], one["train_loss"], rtol=SAME_RUN)
    np.testing.assert_allclose(two["final_eval_loss"], one["final_eval_loss"], rtol=SAME_RUN)
    assert alone.splitlines()[-4:] == [
        line.replace(str(workdir), str(reference)) for line in first.splitlines()[-4:]
    ]


# What a C++ stack or a fatal log of jax's runtime looks like in stderr: absl's "F" lines,
# "*** Check failure stack trace: ***" and its "    @     0x7f..." frames.
_CPP_STACK = re.compile(r"^(F\d{4} |\*\*\* Check failure|\s+@\s+0x)", re.M)


def test_a_lost_process_stops_the_other_which_resumes_to_the_uninterrupted_run(lm, tmp_path):
    """docs/multihost.md, "When a host is lost": process 1 killed with SIGKILL after its
    second checkpoint, as a preempted host would be. Process 0 stops within a minute with
    exit code 75 and four lines (the lost process, the newest complete checkpoint, the
    --resume command), no C++ stack; both resume with that command and --steps N alone
    (the rest from the run's config.json), and the resumed run equals one process with
    two devices on the same schedule, bit for bit, from step 1 to N."""
    workdir, reference, steps = tmp_path / "run", tmp_path / "one", 32
    # 400 steps on the schedule: the run is in its first steps when killed. The same run
    # in one process with two devices trains to `steps` meanwhile.
    # Evaluations at the last step only: no eval step to compile before the kill.
    argv = [*TINY, "--eval-every=400", "--steps=400", "--workdir", str(workdir)]
    commands = _launch(argv, _free_port())
    processes = [_start(c, 1, tmp_path / f"p{i}") for i, c in enumerate(commands)]
    one = [*TINY, "--eval-every=400", f"--steps={steps}", "--schedule-steps=400"]
    one += ["--workdir", str(reference)]
    single = _start([sys.executable, str(EXAMPLE), *one], 2, tmp_path / "one")
    second_checkpoint = workdir / "checkpoints" / "8"  # complete: orbax renamed it
    deadline = time.monotonic() + 600
    while not second_checkpoint.is_dir():
        assert processes[0].poll() is None and processes[1].poll() is None, "a process ended"
        assert time.monotonic() < deadline, "no second checkpoint in 10 minutes"
        time.sleep(0.05)
    processes[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    _, err = _finished(processes[0], tmp_path / "p0", timeout=120)
    stopped = time.monotonic() - killed
    assert processes[1].wait(timeout=60) == -signal.SIGKILL
    print(f"process 0 stopped {stopped:.1f} s after process 1 was killed")

    # The stop: within a minute, exit code 75, four lines and no stack.
    assert processes[0].returncode == lm.lost_process.EXIT_LOST, err[-3000:]
    assert stopped < 60, f"process 0 stopped {stopped:.0f} s after process 1 was killed"
    assert not _CPP_STACK.search(err) and "Traceback" not in err, err[-3000:]
    lines = err.splitlines()[-4:]
    assert lines[0].startswith("error: lost process 1 of 2: no sign of life on jax's"), lines
    saved = lm.checkpoint.checkpoint_steps(workdir)
    assert 8 <= saved[-1] < steps, saved
    assert lines[1] == f"newest complete checkpoint: {workdir}/checkpoints/{saved[-1]}"
    command = shlex.split(lines[3])
    assert command[2:5] == ["--resume", "--workdir", str(workdir)], command
    assert command[-2:] == ["--process-id", "0"] and "--steps" not in command

    # Both processes resume with the printed command and --steps alone.
    resumed = [
        _start([*command[:-1], str(i), f"--steps={steps}"], 1, tmp_path / f"r{i}") for i in (0, 1)
    ]
    for p, log in zip((*resumed, single), ("r0", "r1", "one"), strict=True):
        _, err = _finished(p, tmp_path / log)
        assert p.returncode == 0, err[-3000:]
    out = (tmp_path / "r0.out").read_text()
    assert f"resumed from step {saved[-1]} of {workdir / 'checkpoints'}" in out
    run, one = _metrics(workdir), _metrics(reference)
    assert run["resumed_from"] == saved[-1] and len(run["train_loss"]) == steps
    assert run["config"] == one["config"]  # the saved config, --steps apart
    np.testing.assert_allclose(run["train_loss"], one["train_loss"], rtol=SAME_RUN)
    np.testing.assert_allclose(run["final_eval_loss"], one["final_eval_loss"], rtol=SAME_RUN)
