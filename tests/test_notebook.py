"""Executes notebooks/rmsnorm_tour.ipynb from scratch in a fresh kernel."""

from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]


def test_tour_notebook_executes():
    path = ROOT / "notebooks" / "rmsnorm_tour.ipynb"
    nb = nbformat.read(path, as_version=4)
    # A fresh kernel: the notebook sets its own XLA_FLAGS before importing jax.
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()
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
