"""Tests of examples/train_lm.py (the command line) and its parts in examples/lm/ with a tiny
configuration: training, and a workdir that never mixes two runs (refused, resumed,
overwritten, killed and resumed).

The example builds its mesh from the default backend's devices: eight host CPUs here
(conftest.py), one device on a single-GPU machine.
"""

import contextlib
import dataclasses
import importlib.util
import io
import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import deviceless_skip_reason

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_lm.py"

# The command line of a tiny run: 12 steps of a 1-layer, d=32 model, checkpoints every 4.
TINY = [
    "--steps=12",
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

# Two runs agree to this relative tolerance when they are the same run: the same XLA
# program on the same inputs, which XLA:CPU computes bit for bit alike (XLA on a GPU
# does not promise bitwise-reproducible reductions). A mixed-up run is far outside it:
# measured, this 12-step run on an 8-step schedule ends with a validation loss 1.0 % off
# (train losses 2e-3 off from step 5), and with another seed 1.2 % off.
SAME_RUN = 1e-6


@pytest.fixture(scope="module")
def train_lm():
    """The command line, loaded from its file (which puts examples/ on sys.path for lm/)."""
    spec = importlib.util.spec_from_file_location("train_lm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_lm"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def lm(train_lm):
    """The example's package, examples/lm/ (on sys.path once train_lm is loaded)."""
    import lm
    import lm.compile_for  # the one part train_lm imports only for --compile-for

    return lm


def _tiny(train_lm, **overrides):
    cfg, _ = train_lm.parse_args(TINY)
    return dataclasses.replace(cfg, **overrides)


def _run(train_lm, *argv) -> tuple[int, str]:
    """``main(TINY + argv)``: its exit code and what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = train_lm.main([*TINY, *map(str, argv)])
    return code, out.getvalue()


def _metrics(workdir: Path) -> dict:
    return json.loads((workdir / "metrics.json").read_text())


def _snapshot(workdir: Path) -> dict[str, tuple[int, int] | None]:
    """Every path under ``workdir`` with its size and modification time (files)."""
    return {
        str(p.relative_to(workdir)): (p.stat().st_size, p.stat().st_mtime_ns)
        if p.is_file()
        else None
        for p in sorted(workdir.rglob("*"))
    }


@pytest.fixture(scope="module")
def first_run(train_lm, tmp_path_factory):
    """The uninterrupted run: its workdir, metrics and printed output."""
    workdir = tmp_path_factory.mktemp("run")
    code, out = _run(train_lm, "--workdir", workdir)
    assert code == 0, out
    return workdir, _metrics(workdir), out


@pytest.fixture
def copied_run(first_run, tmp_path):
    """A copy of the first run's workdir, for a test to resume, refuse or overwrite."""
    workdir = tmp_path / "run"
    shutil.copytree(first_run[0], workdir)
    return workdir


def test_loss_decreases_and_outputs_are_written(first_run):
    workdir, metrics, out = first_run
    losses = metrics["train_loss"]
    assert len(losses) == 12 and len(metrics["step_time"]) == 12
    assert np.mean(losses[-3:]) < losses[0] - 0.3
    evals = [e["loss"] for e in metrics["eval"]]
    assert [e["step"] for e in metrics["eval"]] == [4, 8, 12]
    assert evals[-1] < evals[0]
    assert (workdir / "loss.png").stat().st_size > 10_000
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["12", "8"]
    # Byte entropy of real text sits between 2 and 5 nats.
    assert 2.0 < metrics["unigram_entropy"] < 5.0
    # The config beside the checkpoints, with the schedule the run trained on.
    config = json.loads((workdir / "config.json").read_text())
    assert config == metrics["config"]
    assert (config["steps"], config["schedule_steps"], config["warmup_steps"]) == (12, 12, 1)
    # The last lines say where everything is.
    assert out.splitlines()[-4:] == [
        f"checkpoints: {workdir / 'checkpoints'} (steps 8, 12; --resume continues the latest)",
        f"config:      {workdir / 'config.json'}",
        f"metrics:     {workdir / 'metrics.json'}",
        f"plot:        {workdir / 'loss.png'}",
    ]
    assert "final validation loss" in out and "resumed" not in out
    # Every evaluation line names the norm, with or without the progress bar.
    evals = [line for line in out.splitlines() if line.endswith("nats/byte")]
    assert [line.split(":")[0] for line in evals] == [f"rmsnorm | step {n}" for n in (4, 8, 12)]


@pytest.mark.parametrize("remove", [None, "config.json"])
def test_a_workdir_that_holds_a_run_needs_resume_or_overwrite(train_lm, capsys, copied_run, remove):
    before = _snapshot(copied_run)
    if remove is None:
        code, _ = _run(train_lm, "--workdir", copied_run)
        expected = ["already holds a run (checkpoints at steps 8, 12", "--resume", "--overwrite"]
    else:  # e.g. checkpoints written by an older version: nothing to check them against
        (copied_run / remove).unlink()
        before = _snapshot(copied_run)
        code, _ = _run(train_lm, "--workdir", copied_run, "--resume")
        expected = ["holds checkpoints at steps 8, 12", "but no config.json", "--overwrite"]
    assert code == 2
    err = capsys.readouterr().err
    assert all(text in err for text in expected), err
    assert _snapshot(copied_run) == before  # refused before touching anything


@pytest.mark.parametrize("steps", [12, 6])
def test_resume_at_or_past_the_last_step_trains_nothing(train_lm, copied_run, steps):
    before = _snapshot(copied_run)
    # --steps and --eval-every may differ on resume; the rest of the config is the run's.
    code, out = _run(
        train_lm, "--workdir", copied_run, "--resume", f"--steps={steps}", "--eval-every=2"
    )
    assert code == 0
    assert out.startswith(
        f"nothing to train: the run in {copied_run} is at step 12 and --steps is {steps}"
    )
    assert "final validation loss" not in out and f"plot:        {copied_run}" in out
    assert _snapshot(copied_run) == before


def test_resume_refuses_another_config_and_names_the_fields(train_lm, capsys, copied_run):
    before = _snapshot(copied_run)
    argv = ["--resume", "--d-model=64", "--seed=1", "--schedule-steps=20", "--steps=20"]
    code, _ = _run(train_lm, "--workdir", copied_run, *argv)
    assert code == 2
    err = capsys.readouterr().err
    assert "differs from the run saved in" in err and "--overwrite" in err
    for field in ("d_model (saved 32, now 64)", "seed (saved 0, now 1)", "schedule_steps"):
        assert field in err
    assert "steps (saved" not in err.replace("schedule_steps", "")  # steps may differ
    assert _snapshot(copied_run) == before


def test_resume_takes_the_saved_config_for_the_flags_not_given(train_lm, capsys, copied_run):
    """--resume with --steps alone (no TINY flags): the model, data, seed, schedule,
    intervals and --no-progress are the saved run's; a flag given with another value is
    still refused, and only that one is named."""
    code = train_lm.main(["--workdir", str(copied_run), "--resume", "--seed", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "in seed (saved 0, now 1). Only steps" in err, err
    code = train_lm.main(["--workdir", str(copied_run), "--resume", "--steps", "14"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith(
        f"resumed from step 12 of {copied_run / 'checkpoints'}, training to step 14"
    )
    assert "at step 14," in out
    resumed = _metrics(copied_run)
    saved = json.loads((copied_run / "config.json").read_text())
    assert resumed["config"] == saved
    assert (saved["steps"], saved["d_model"], saved["schedule_steps"]) == (14, 32, 12)
    assert (saved["eval_every"], saved["progress"]) == (4, False)
    assert resumed["resumed_from"] == 12 and len(resumed["train_loss"]) == 14


def test_resume_keeps_the_saved_schedule(train_lm, lm, first_run):
    """--steps moves where a resumed run stops; its learning-rate schedule stays the one
    it started with, so an extended run does not restart its warmup and decay."""
    workdir = first_run[0]
    resumed = lm.workdir.plan_run(_tiny(train_lm, steps=30), workdir, resume=True, overwrite=False)
    assert (resumed.steps, resumed.schedule_steps, resumed.warmup_steps) == (30, 12, 1)
    fresh = lm.workdir.plan_run(_tiny(train_lm, steps=30), workdir, resume=False, overwrite=True)
    assert (fresh.steps, fresh.schedule_steps, fresh.warmup_steps) == (30, 30, 3)


def test_overwrite_then_a_planned_stop_resumes_exactly(train_lm, lm, first_run, copied_run):
    _, uninterrupted, _ = first_run
    # Start afresh, and stop at step 8 on the 12-step schedule of the uninterrupted run.
    code, out = _run(
        train_lm, "--workdir", copied_run, "--overwrite", "--steps=8", "--schedule-steps=12"
    )
    assert code == 0
    assert out.startswith(f"--overwrite: removed the previous run in {copied_run} (checkpoints")
    assert lm.checkpoint.checkpoint_steps(copied_run) == [4, 8]  # the old run's 12 is gone
    stopped = _metrics(copied_run)
    assert stopped["resumed_from"] is None and len(stopped["train_loss"]) == 8
    np.testing.assert_allclose(
        stopped["train_loss"], uninterrupted["train_loss"][:8], rtol=SAME_RUN
    )

    code, out = _run(train_lm, "--workdir", copied_run, "--resume")  # --steps=12
    assert code == 0
    assert out.startswith(f"resumed from step 8 of {copied_run / 'checkpoints'}")
    resumed = _metrics(copied_run)
    assert resumed["resumed_from"] == 8 and resumed["steps_trained"] == 4
    assert resumed["train_loss"][:8] == stopped["train_loss"]
    np.testing.assert_allclose(resumed["train_loss"], uninterrupted["train_loss"], rtol=SAME_RUN)
    np.testing.assert_allclose(
        resumed["final_eval_loss"], uninterrupted["final_eval_loss"], rtol=SAME_RUN
    )
    assert json.loads((copied_run / "config.json").read_text())["steps"] == 12


# Runs the example's command line and kills the process with SIGKILL, as `kill -9` or a
# preempted machine would, when it reaches a given step: no cleanup, no final files.
_KILLED_AT_STEP = """
import os, signal, sys
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import train_lm  # first: it chooses jax's platforms
import lm.data
kill_at, batch_at = int(sys.argv[2]), lm.data.batch_at

def batch_or_die(tokens, step, cfg, seed):
    if step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    return batch_at(tokens, step, cfg, seed)

lm.data.batch_at = batch_or_die
sys.exit(train_lm.main(sys.argv[3:]))
"""


def test_a_killed_run_resumes_to_the_final_loss_of_an_uninterrupted_one(
    train_lm, lm, first_run, tmp_path
):
    _, uninterrupted, _ = first_run
    workdir = tmp_path / "killed"
    argv = [sys.executable, "-c", _KILLED_AT_STEP, str(EXAMPLE), "9", *TINY]
    killed = subprocess.run(
        [*argv, f"--workdir={workdir}"], capture_output=True, text=True, timeout=600
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    # Killed in step 9: step 4 is saved (orbax finishes a save before it starts the
    # next), step 8 too unless the kill caught it half-written; no metrics, no plot.
    saved = lm.checkpoint.checkpoint_steps(workdir)
    assert saved[-1] in (4, 8), saved
    assert not (workdir / "metrics.json").exists() and (workdir / "config.json").exists()

    code, out = _run(train_lm, "--workdir", workdir, "--resume")
    assert code == 0
    assert out.startswith(f"resumed from step {saved[-1]} of {workdir / 'checkpoints'}")
    resumed = _metrics(workdir)
    assert resumed["resumed_from"] == saved[-1] and len(resumed["train_loss"]) == 12
    np.testing.assert_allclose(resumed["train_loss"], uninterrupted["train_loss"], rtol=SAME_RUN)
    np.testing.assert_allclose(
        resumed["final_eval_loss"], uninterrupted["final_eval_loss"], rtol=SAME_RUN
    )


def test_compare_refuses_before_training_any_norm(train_lm, lm, tmp_path):
    (tmp_path / "layernorm").mkdir()
    (tmp_path / "layernorm" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="layernorm already holds a run"):
        lm.train.compare(_tiny(train_lm), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["layernorm"]


def test_compare_gives_the_ratio_with_its_spread(lm):
    """The step-time table of --compare: medians and quartiles after 5 warm-up steps, and
    the ratio to LayerNorm with the spread its quartiles allow (numbers by hand)."""
    warm_up = [9.0] * 5  # seconds: compiling; left out

    def run(ms):
        return {
            "step_time": warm_up + [t / 1e3 for t in ms],
            "final_eval_loss": 2.5,
            "wall_time": 1,
        }

    rows = lm.report.step_time_table(
        {"rmsnorm": run([8, 9, 10, 11, 12]), "layernorm": run([10, 11, 12, 13, 14])}
    )
    by_norm = {r["norm"]: r for r in rows}
    ours = by_norm["rmsnorm"]
    assert (ours["q1_step_ms"], ours["median_step_ms"], ours["q3_step_ms"]) == pytest.approx(
        (9, 10, 11)
    )
    assert ours["vs_layernorm"] == pytest.approx(10 / 12)
    assert (ours["vs_layernorm_low"], ours["vs_layernorm_high"]) == pytest.approx((9 / 13, 1.0))
    assert by_norm["layernorm"]["vs_layernorm"] == 1.0


def test_data_and_model_mesh_on_eight_devices(train_lm, lm, first_run, tmp_path):
    if jax.device_count() < 8:
        pytest.skip(
            f"needs 8 devices of the default backend (train_lm builds its mesh from "
            f"jax.devices()); {jax.default_backend()} has {jax.device_count()}"
        )
    _, metrics, _ = first_run
    assert metrics["mesh"] == {"data": 8, "model": 1}
    split = lm.train.train_and_evaluate(
        _tiny(train_lm, mesh=(4, 2), steps=4, schedule_steps=12), tmp_path
    )
    assert split["mesh"] == {"data": 4, "model": 2}
    # Same seed, data and maths: the losses agree with the data-parallel run.
    np.testing.assert_allclose(split["train_loss"], metrics["train_loss"][:4], rtol=2e-3)


@pytest.mark.parametrize("norm", ["prmsnorm", "layernorm"])
def test_other_norms_train(train_lm, lm, tmp_path, norm):
    cfg = _tiny(train_lm, norm=norm, steps=8, checkpoint_every=8)
    m = lm.train.train_and_evaluate(cfg, tmp_path)
    assert np.mean(m["train_loss"][-3:]) < m["train_loss"][0] - 0.3
    # One checkpoint per interval and the last step: none at step 1 (orbax's own policy
    # saves a run's first step too).
    assert lm.checkpoint.checkpoint_steps(tmp_path) == [8]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "--steps must be >= 1"),
        (["--p", "1.5"], "--p must be in (0, 1]"),
        (["--norm", "batchnorm"], "invalid choice"),
        (["--mesh", "two"], "--mesh takes DATA,MODEL"),
        (["--d-model", "30", "--num-heads", "4"], "must be divisible by --num-heads"),
        (["--schedule-steps", "0"], "--schedule-steps must be >= 1"),
        (["--resume", "--overwrite"], "argument --overwrite: not allowed with argument --resume"),
    ],
)
def test_bad_flags_exit_with_a_message(train_lm, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        train_lm.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("content", [None, b""])
def test_missing_or_empty_data_file(train_lm, capsys, tmp_path, content):
    path = tmp_path / "corpus.txt"
    if content is not None:
        path.write_bytes(content)
    assert train_lm.main(["--data", str(path), "--workdir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert "error: --data" in err and ("no such file" in err or "empty" in err)
    assert "Traceback" not in err


def test_mesh_that_does_not_fit_the_devices(train_lm, capsys, tmp_path):
    assert train_lm.main(["--mesh", "3,3", "--workdir", str(tmp_path)]) == 2
    assert f"needs 9 devices; this run has {jax.device_count()}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, False),
        ({"SLURM_NTASKS": "1"}, False),
        ({"SLURM_NTASKS": "4"}, True),
        ({"OMPI_COMM_WORLD_SIZE": "2"}, True),
        ({"TPU_WORKER_HOSTNAMES": "t1"}, False),
        ({"TPU_WORKER_HOSTNAMES": "t1,t2,t3,t4"}, True),
        ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, True),
    ],
)
def test_multi_process_launch_is_detected(lm, env, expected):
    assert lm.distributed.launched_as_several_processes(env) is expected


@pytest.mark.parametrize(
    "target, mesh, unit", [("tpu-v5e:2x2", "2,2", "cycles"), ("h100x8", "4,2", "us")]
)
def test_compile_for_a_pod_without_training(
    train_lm, lm, capsys, tmp_path, monkeypatch, target, mesh, unit
):
    if reason := deviceless_skip_reason(target):
        pytest.skip(reason)
    # The command's one compile, its report kept (a second compile would double minutes).
    reports = []
    compile_for = lm.compile_for.compile_for

    def recorded(*args):
        reports.append(compile_for(*args))
        return reports[-1]

    monkeypatch.setattr(lm.compile_for, "compile_for", recorded)
    workdir = tmp_path / "w"
    argv = ["--compile-for", target, "--mesh", mesh, "--workdir", str(workdir)]
    assert train_lm.main(argv) == 0
    out = capsys.readouterr().out
    assert target in out and "temporaries" in out and f" {unit} per step" in out
    assert not workdir.exists()  # nothing trained, nothing written
    (report,) = reports
    assert report["temp_bytes_per_device"] > 0 and report["step_estimate"] > 0
    # Parameters and Adam's two moments in float32, the model axis splitting some.
    params = sum(
        np.prod(a.shape)
        for a in jax.tree.leaves(lm.train.Trainer(lm.config.Config()).abstract_state["params"])
    )
    assert 3 * 4 * params / 2 <= report["state_bytes_per_device"] <= 3 * 4 * params + 1024


def test_compile_for_an_unknown_target(train_lm, capsys):
    assert train_lm.main(["--compile-for", "tpu-v9"]) == 2
    err = capsys.readouterr().err
    assert "unknown compile target 'tpu-v9'" in err and "tpu-v5e" in err


# ---------------------------------------------------------------- several processes


def test_a_lost_process_names_the_norm_being_trained_and_the_command_to_go_on(
    train_lm, lm, tmp_path
):
    """The stop's lines on --compare, lost while the second norm has no checkpoint yet:
    that norm's workdir, and the command that resumes the comparison on this process
    (--compare and the launch flags; the Config flags come from each config.json)."""
    for norm in ("rmsnorm", "prmsnorm"):  # prmsnorm started: it holds a config.json
        (tmp_path / norm).mkdir()
        (tmp_path / norm / "config.json").write_text("{}")
    launch = ["--coordinator-address", "h:1", "--num-processes", "2", "--process-id", "1"]
    _, args = train_lm.parse_args(["--compare", "--steps=9", "--workdir", str(tmp_path), *launch])
    lines = lm.lost_process.stop_message([0], args, script=str(EXAMPLE))
    assert lines[0].startswith("error: lost process 0 of ") and " for 10 s. " in lines[0]
    assert lines[1:3] == [
        f"no complete checkpoint in {tmp_path / 'prmsnorm'} yet: --resume starts from step 0",
        "to go on, start every process again with --resume (each with its own --process-id); "
        "this one:",
    ]
    command = shlex.split(lines[3])
    assert Path(command[1]).resolve() == EXAMPLE
    assert command[2:] == ["--resume", "--workdir", str(tmp_path), "--compare", *launch]


def _launch_args(train_lm, lm, argv, env):
    _, args = train_lm.parse_args(argv)
    return lm.distributed.distributed_options(args, env)


@pytest.mark.parametrize(
    "argv, env, expected",
    [
        ([], {}, None),
        (
            [
                "--coordinator-address",
                "localhost:1234",
                "--num-processes",
                "2",
                "--process-id",
                "1",
            ],
            {},
            {"coordinator_address": "localhost:1234", "num_processes": 2, "process_id": 1},
        ),
        (  # the environment variables named in --help, flags first
            ["--process-id", "0"],
            {
                "JAX_COORDINATOR_ADDRESS": "10.0.0.1:99",
                "JAX_NUM_PROCESSES": "4",
                "JAX_PROCESS_ID": "3",
            },
            {"coordinator_address": "10.0.0.1:99", "num_processes": 4, "process_id": 0},
        ),
        (["--distributed"], {"SLURM_NTASKS": "4"}, {}),  # jax reads the rest from SLURM
    ],
)
def test_distributed_options_from_flags_and_environment(train_lm, lm, argv, env, expected):
    assert _launch_args(train_lm, lm, argv, env) == expected


@pytest.mark.parametrize(
    "argv, env, message",
    [
        (  # the launch: a coordinator and nothing else
            ["--distributed"],
            {"JAX_COORDINATOR_ADDRESS": "localhost:1234"},
            "missing --num-processes (or JAX_NUM_PROCESSES), --process-id (or JAX_PROCESS_ID)",
        ),
        (["--distributed"], {}, "missing --coordinator-address (or JAX_COORDINATOR_ADDRESS)"),
        (
            ["--coordinator-address", "localhost", "--num-processes", "2", "--process-id", "0"],
            {},
            "--coordinator-address 'localhost' is not HOST:PORT",
        ),
        (
            ["--coordinator-address", "h:1", "--num-processes", "2", "--process-id", "2"],
            {},
            "--process-id 2 is outside 0..1",
        ),
        (
            ["--coordinator-address", "h:1", "--process-id", "0"],
            {"JAX_NUM_PROCESSES": "two"},
            "JAX_NUM_PROCESSES='two' is not an integer",
        ),
    ],
)
def test_an_incomplete_launch_is_refused_before_jax_starts(
    train_lm, lm, capsys, argv, env, message
):
    with pytest.raises(ValueError, match=re.escape(message)):
        _launch_args(train_lm, lm, argv, env)
    if not env:  # the command line itself: exit 2 with the message, no traceback
        assert train_lm.main([*argv, "--workdir", "unused"]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err


def test_a_start_that_failed_before_its_first_checkpoint_does_not_block_a_retry(
    train_lm, lm, monkeypatch, capsys, tmp_path
):
    workdir = tmp_path / "w"
    batch_at = lm.data.batch_at

    def fail_at_the_first_step(tokens, step, cfg, seed):  # after the workdir is written
        raise RuntimeError("the start fails here")

    monkeypatch.setattr(lm.data, "batch_at", fail_at_the_first_step)
    with pytest.raises(RuntimeError, match="the start fails here"):
        _run(train_lm, "--workdir", workdir)
    monkeypatch.setattr(lm.data, "batch_at", batch_at)
    assert lm.workdir.previous_run(workdir) == ["config.json"]  # what the start left

    # Another command is still refused: that config.json is not its run.
    before = _snapshot(workdir)
    code, _ = _run(train_lm, "--workdir", workdir, "--seed=1")
    assert code == 2 and "already holds a run (config.json)" in capsys.readouterr().err
    assert _snapshot(workdir) == before

    # The same command starts again from step 0, and says why it may.
    code, out = _run(train_lm, "--workdir", workdir, "--steps=4", "--schedule-steps=12")
    assert code == 0
    assert out.startswith(f"{workdir} holds what a start of this command left before its first")
    assert _metrics(workdir)["resumed_from"] is None and lm.checkpoint.checkpoint_steps(
        workdir
    ) == [4]
