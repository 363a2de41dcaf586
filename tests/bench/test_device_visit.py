"""``benchmarks/device_visit.sh``: its dry run (CI's, on a CPU) runs the real visit's steps in
the same order, and each way of handling a failed step.

The script runs for real, in a folder laid out like the repository, with a stand-in for
Python that records how it is called (one line per call, as the shell quotes it) and fails
where told: what is checked is the script's own logic, in well under a second per run. The
dry run of the real programs is CI's (``.ci/device_dry_run.sh``).
"""

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "device_visit.sh"
# Python, as the visit calls it: each call on a line of $CALLS; the one whose arguments
# contain $FAIL_ON exits 3; a benchmark prints paths of the machine, which the log must lose.
STAND_IN = """#!/usr/bin/env bash
printf '%q ' "$@" >> "$CALLS"
echo >> "$CALLS"
case "$*" in
  "-c import sys; print(sys.prefix)") echo "$STAND_IN_PREFIX"; exit 0 ;;
  *xprof*) exit 1 ;;
esac
echo "running in $PWD/here with PYTHONPATH $PYTHONPATH from $STAND_IN_PREFIX/lib"
if [ -n "$FAIL_ON" ] && [[ "$*" == *"$FAIL_ON"* ]]; then exit 3; fi
"""
# What only the dry run or only the visit passes (an option and how many values follow it).
MODE_OPTIONS = {"--quick": 0, "--rounds": 1, "--sizes": 1, "-n": 1, "-k": 1}
ABSOLUTE = re.compile(r"(?<![\w.])/(?:tmp|work|root|home|Users|opt|mnt|var|usr)/")


def _tree(tmp_path: Path) -> Path:
    """A folder with what the script finds in the repository: wheels, the test files."""
    root = tmp_path / "repo"
    files = ["tests/kernels/test_x.py", "wheels/tokamax-0-py3-none-any.whl"]
    for name in files + [
        f"tests/core/{t}.py" for t in ("test_residual_rounding", "test_add_and_gated")
    ]:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("")
    return root


def _visit(tmp_path: Path, *flags: str, fail_on: str = ""):
    """Runs the script (``flags``: ``--dry-run`` or none): its result, the stand-in's calls
    (each as argv) and the log."""
    root, out = _tree(tmp_path), tmp_path / "out"
    out.mkdir()
    stand_in, calls = tmp_path / "python", tmp_path / "calls.txt"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    env = dict(os.environ, PYTHON=str(stand_in), CALLS=str(calls), FAIL_ON=fail_on)
    env |= dict(BENCHMARKS_COMMIT="abc1234", STAND_IN_PREFIX=str(tmp_path / "prefix"))
    done = subprocess.run(
        ["bash", str(SCRIPT), *flags, str(out)],
        cwd=root, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert not (root / "RESULTS").exists()  # the link to OUT is gone
    argv = [shlex.split(line) for line in calls.read_text().splitlines()]
    return done, argv, (out / "log.txt").read_text()


def _steps(argv: list[list[str]]) -> list[list[str]]:
    """The calls without the options that say which way the visit runs, and with the
    install's folder (a new one each run) as ``SITE``."""
    steps = []
    for call in argv:
        kept, skip = [], 0
        for arg in call:
            if skip:
                skip -= 1
            elif arg in MODE_OPTIONS:
                skip = MODE_OPTIONS[arg]
            else:
                kept.append("SITE" if kept[-1:] == ["--target"] else arg)
        steps.append(kept)
    return steps


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    if shutil.which("timeout") is None:
        pytest.skip("the visit needs coreutils' timeout")
    real = _visit(tmp_path_factory.mktemp("visit"))
    dry = _visit(tmp_path_factory.mktemp("dry"), "--dry-run")
    return real, dry


def test_the_dry_run_runs_the_visits_steps_in_the_same_order(both):
    (real, real_argv, _), (dry, dry_argv, _) = both
    assert real.returncode == 0 and dry.returncode == 0, (real.stderr, dry.stderr)
    assert _steps(dry_argv) == _steps(real_argv)
    modules = [call[1:3] for call in real_argv if call[0] == "-m"]
    assert modules == [
        ["pip", "install"], ["pytest", "-q"],
        ["benchmarks", "ops"], ["benchmarks", "step"], ["benchmarks", "gemma"],
    ]  # fmt: skip
    install = next(call for call in dry_argv if call[1:3] == ["pip", "install"])
    assert {"--no-index", "--no-deps", "--target"} <= set(install)
    assert any("import jax, tokamax" in " ".join(call) for call in dry_argv)


def test_the_dry_run_takes_the_smallest_sizes_and_the_visit_the_full_ones(both):
    (_, real_argv, _), (_, dry_argv, _) = both
    for argv, sizes in ((real_argv, ["--rounds", "3"]), (dry_argv, ["--quick"])):
        for call in argv:
            if call[1:2] == ["benchmarks"]:
                assert call[3 : 3 + len(sizes)] == sizes, call
                assert call[-2:] == ["--out", "RESULTS"]
    pytest_call = next(call for call in real_argv if call[1:2] == ["pytest"])
    assert "-p" in pytest_call and "no:benchmark" in pytest_call and "-k" not in pytest_call
    assert {"tests/kernels", "tests/core/test_residual_rounding.py"} <= set(pytest_call)


def test_the_log_names_each_step_and_no_folder_of_the_machine(both):
    for _, _, log in both:
        assert log.startswith("=== tree at abc1234")
        assert log.count("=== exit 0 after") == 6  # pip, import, tests, ops, step, gemma
        assert "xprof: a stub" in log and "every step passed" in log
        assert not ABSOLUTE.search(log), ABSOLUTE.search(log)
        assert "SITE" in log and "PYTHON" in log  # the install folder and the prefix, named


def test_a_failed_step_stops_the_dry_run_there(tmp_path):
    done, argv, log = _visit(tmp_path, "--dry-run", fail_on="benchmarks step")
    assert done.returncode == 3
    assert [call[2] for call in argv if call[1:2] == ["benchmarks"]] == ["ops", "step"]
    assert "=== exit 3 after" in log and "dry run: stopped" in log


def test_the_visit_goes_on_past_a_failed_step_and_says_so(tmp_path):
    done, argv, log = _visit(tmp_path, fail_on="benchmarks step")
    assert done.returncode == 1
    assert [call[2] for call in argv if call[1:2] == ["benchmarks"]] == ["ops", "step", "gemma"]
    assert "=== exit 3 after" in log
    assert re.search(r"=== failed: .*-m benchmarks step.* \(exit 3\)", log), log[-500:]


def test_the_tune_call_times_the_mosaic_gpu_sizings_and_its_dry_run_the_same(tmp_path):
    """``--tune``, the visit's second call: the Mosaic GPU sweep alone (no install, no
    tests), over the widths the runbook names; its dry run the same call at ``--quick``."""
    calls = {}
    for name, flags in (("real", ["--tune"]), ("dry", ["--dry-run", "--tune"])):
        (tmp_path / name).mkdir()
        done, argv, log = _visit(tmp_path / name, *flags)
        assert done.returncode == 0, done.stderr
        assert "every step passed" in log and not ABSOLUTE.search(log)
        assert argv[0] == ["--version"] and argv[2:] == [["-c", "import sys; print(sys.prefix)"]]
        calls[name] = argv[1]
    head = ["-m", "benchmarks.kernel_sizes", "--backend", "mosaic_gpu"]
    widths = ["--widths", "128", "1024", "2048", "4096", "8192", "16384"]
    assert calls["real"] == [*head, "--rounds", "3", *widths, "--out", "RESULTS"]
    assert calls["dry"] == [*head, "--quick", "--out", "RESULTS"]
