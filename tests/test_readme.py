"""The README's code blocks run, and .ci/run runs the README's test command as written."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(lang):
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_readme_starts_with_the_two_commands():
    first, second = _blocks("bash")[:2]
    assert "examples/train_lm.py" in first and "pip install" in first
    assert "pytest" in second and '".[test]"' in second
    assert README.index(first) < README.index("## ")


def test_ci_runs_the_readme_test_command():
    command = _blocks("bash")[1].strip().splitlines()[-1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "README.md" in ci and "Install and run the tests" in ci
    assert command.startswith("python3 -m venv .venv")


def test_python_blocks_run():
    namespace = {}
    for block in _blocks("python"):
        exec(compile(block, "README.md", "exec"), namespace)
