"""Executes notebooks/rmsnorm_tour.ipynb from scratch in a fresh kernel, away from the checkout."""

import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]


def test_tour_notebook_executes_anywhere_and_writes_only_to_a_temporary_directory(tmp_path):
    path = ROOT / "notebooks" / "rmsnorm_tour.ipynb"
    nb = nbformat.read(path, as_version=4)
    elsewhere = tmp_path / "cwd"  # the kernel starts here: not notebooks/, not the checkout
    temp = tmp_path / "tmp"  # tempfile's directory in the kernel
    elsewhere.mkdir()
    temp.mkdir()
    notebooks_before = sorted(path.parent.iterdir())
    # A cell of the test's own, after the one that makes the scratch folder, reports where it is
    # (the notebook prints no path, so that its stored outputs name no machine's folder).
    setup = next(i for i, c in enumerate(nb.cells) if "TemporaryDirectory(" in c.source)
    nb.cells.insert(
        setup + 1,
        nbformat.v4.new_code_cell(
            "import os as _os\nprint('scratch:', _os.path.relpath(SCRATCH, _os.environ['TMPDIR']))"
        ),
    )
    # A fresh kernel: the notebook sets its own JAX_PLATFORMS and XLA_FLAGS before jax.
    NotebookClient(
        nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(elsewhere)}}
    ).execute(env={**os.environ, "TMPDIR": str(temp)})
    errors = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]
    assert not errors
    images = sum(
        "image/png" in o.get("data", {})
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
    )
    assert images == 4  # sections 2, 4, 6 and 8 each draw one figure
    printed = "".join(
        o.get("text", "")
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.get("name") == "stdout"
    )
    # Its files went under tempfile's directory, and its last cell removed them.
    scratch = [line for line in printed.splitlines() if line.startswith("scratch: ")]
    assert len(scratch) == 1 and scratch[0].startswith("scratch: rmsnorm_tour_"), scratch
    assert os.sep not in scratch[0]  # directly under TMPDIR, not in a folder above or beside it
    assert "the temporary folder deleted: True" in printed
    assert list(temp.iterdir()) == []
    assert list(elsewhere.iterdir()) == []
    assert sorted(path.parent.iterdir()) == notebooks_before
    # Every training line says which norm it belongs to.
    training_lines = [line for line in printed.splitlines() if "nats/byte" in line]
    assert len(training_lines) == 4 * 6  # 4 runs, 6 evaluations each
    for line in training_lines:
        label, _, rest = line.partition(" | ")
        assert label.strip().split(",")[0] in ("rmsnorm", "prmsnorm", "layernorm"), line
        assert rest.startswith("step "), line


def _requirement_names(requirements, extras=()):
    """Distribution names of ``requirements`` that apply without extras or with ``extras``."""
    from packaging.requirements import Requirement

    names = set()
    for text in requirements or ():
        req = Requirement(text)
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("", *extras)):
            names.add((req.name.lower().replace("_", "-"), frozenset(req.extras)))
    return names


def test_notebook_extra_installs_every_library_the_notebook_imports():
    """``pip install -e ".[notebook]"`` brings every module the notebook imports: each one is
    in the standard library or in a distribution that the extra requires, directly or
    through what that requires (read from the installed metadata)."""
    import json
    import re
    import sys
    from importlib import metadata

    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert {"jupyterlab", "ipykernel"} <= {
        name for name, _ in _requirement_names(extras["notebook"])
    }
    todo = _requirement_names(project["dependencies"] + extras["notebook"])
    closure: set[str] = set()
    while todo:
        name, wanted = todo.pop()
        if name == "rmsnorm-jax":
            for extra in wanted:
                todo |= _requirement_names(extras[extra])
            continue
        if name in closure:
            continue
        closure.add(name)
        try:
            todo |= _requirement_names(metadata.requires(name), wanted)
        except metadata.PackageNotFoundError:
            pass  # not installed here (jupyterlab): its own requirements are not needed below
    nb = json.loads((ROOT / "notebooks" / "rmsnorm_tour.ipynb").read_text())
    imported = {
        match.group(1).split(".")[0]
        for cell in nb["cells"]
        if cell["cell_type"] == "code"
        for line in "".join(cell["source"]).splitlines()
        if (match := re.match(r"\s*(?:from|import)\s+([\w.]+)", line))
    }
    providers = metadata.packages_distributions()
    missing = {
        module: providers.get(module)
        # lm: the example's own parts (examples/lm/), which the notebook imports from there.
        for module in imported - set(sys.stdlib_module_names) - {"rmsnorm_jax", "lm"}
        if not {d.lower().replace("_", "-") for d in providers.get(module, ())} & closure
    }
    assert imported > {"jax", "flax", "matplotlib"} and not missing, missing
