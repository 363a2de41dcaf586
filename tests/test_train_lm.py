"""Smoke tests of examples/train_lm.py with a tiny configuration.

The example builds its mesh from the default backend's devices: eight host CPUs here
(conftest.py), one device on a single-GPU machine.
"""

import dataclasses
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import deviceless_skip_reason

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def train_lm():
    spec = importlib.util.spec_from_file_location("train_lm", ROOT / "examples" / "train_lm.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_lm"] = module
    spec.loader.exec_module(module)
    return module


def _tiny(train_lm, **overrides):
    cfg = train_lm.Config(
        steps=12,
        batch_size=8,
        seq_len=32,
        d_model=32,
        num_heads=2,
        num_layers=1,
        learning_rate=1e-2,
        warmup_steps=2,
        eval_every=4,
        eval_batches=2,
        checkpoint_every=4,
        progress=False,
    )
    return dataclasses.replace(cfg, **overrides)


@pytest.fixture(scope="module")
def first_run(train_lm, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run")
    return workdir, train_lm.train_and_evaluate(_tiny(train_lm), workdir)


def test_loss_decreases_and_outputs_are_written(first_run):
    workdir, metrics = first_run
    losses = metrics["train_loss"]
    assert len(losses) == 12 and len(metrics["step_time"]) == 12
    assert np.mean(losses[-3:]) < losses[0] - 0.3
    evals = [e["loss"] for e in metrics["eval"]]
    assert [e["step"] for e in metrics["eval"]] == [4, 8, 12]
    assert evals[-1] < evals[0]
    assert json.loads((workdir / "metrics.json").read_text())["train_loss"] == losses
    assert (workdir / "loss.png").stat().st_size > 10_000
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["12", "8"]
    # Byte entropy of real text sits between 2 and 5 nats.
    assert 2.0 < metrics["unigram_entropy"] < 5.0


def test_resume_continues_with_the_same_data_order(train_lm, first_run, tmp_path):
    workdir, metrics = first_run
    crashed = tmp_path / "crashed"
    shutil.copytree(workdir, crashed)
    shutil.rmtree(crashed / "checkpoints" / "12")  # the run died after step 8's checkpoint
    resumed = train_lm.train_and_evaluate(_tiny(train_lm), crashed, resume=True)
    assert resumed["resumed_from"] == 8
    assert resumed["train_loss"][:8] == metrics["train_loss"][:8]
    np.testing.assert_allclose(resumed["train_loss"][8:], metrics["train_loss"][8:], rtol=1e-5)
    np.testing.assert_allclose(resumed["final_eval_loss"], metrics["final_eval_loss"], rtol=1e-5)


def test_data_and_model_mesh_on_eight_devices(train_lm, first_run, tmp_path):
    if jax.device_count() < 8:
        pytest.skip(
            f"needs 8 devices of the default backend (train_lm builds its mesh from "
            f"jax.devices()); {jax.default_backend()} has {jax.device_count()}"
        )
    _, metrics = first_run
    assert metrics["mesh"] == {"data": 8, "model": 1}
    split = train_lm.train_and_evaluate(_tiny(train_lm, mesh=(4, 2), steps=4), tmp_path)
    assert split["mesh"] == {"data": 4, "model": 2}
    # Same seed, data and maths: the losses agree with the data-parallel run.
    np.testing.assert_allclose(split["train_loss"], metrics["train_loss"][:4], rtol=2e-3)


@pytest.mark.parametrize("norm", ["prmsnorm", "layernorm"])
def test_other_norms_train(train_lm, tmp_path, norm):
    m = train_lm.train_and_evaluate(_tiny(train_lm, norm=norm, steps=8), tmp_path)
    assert np.mean(m["train_loss"][-3:]) < m["train_loss"][0] - 0.3


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "--steps must be >= 1"),
        (["--p", "1.5"], "--p must be in (0, 1]"),
        (["--norm", "batchnorm"], "invalid choice"),
        (["--mesh", "two"], "--mesh takes DATA,MODEL"),
        (["--d-model", "30", "--num-heads", "4"], "must be divisible by --num-heads"),
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
def test_multi_process_launch_is_detected(train_lm, env, expected):
    assert train_lm.launched_as_several_processes(env) is expected


@pytest.mark.parametrize(
    "target, mesh, unit", [("tpu-v5e:2x2", "2,2", "cycles"), ("h100x8", "4,2", "us")]
)
def test_compile_for_a_pod_without_training(train_lm, capsys, tmp_path, target, mesh, unit):
    if reason := deviceless_skip_reason(target):
        pytest.skip(reason)
    workdir = tmp_path / "w"
    argv = ["--compile-for", target, "--mesh", mesh, "--workdir", str(workdir)]
    assert train_lm.main(argv) == 0
    out = capsys.readouterr().out
    assert target in out and "temporaries" in out and f" {unit} per step" in out
    assert not workdir.exists()  # nothing trained, nothing written
    report = train_lm.compile_for(train_lm.Config(mesh=tuple(map(int, mesh.split(",")))), target)
    assert report["temp_bytes_per_device"] > 0 and report["step_estimate"] > 0
    # Parameters and Adam's two moments in float32, the model axis splitting some.
    params = sum(
        np.prod(a.shape)
        for a in jax.tree.leaves(train_lm.Trainer(train_lm.Config()).abstract_state["params"])
    )
    assert 3 * 4 * params / 2 <= report["state_bytes_per_device"] <= 3 * 4 * params + 1024


def test_compile_for_an_unknown_target(train_lm, capsys):
    assert train_lm.main(["--compile-for", "tpu-v9"]) == 2
    err = capsys.readouterr().err
    assert "unknown compile target 'tpu-v9'" in err and "tpu-v5e" in err
