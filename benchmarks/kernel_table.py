"""python -m benchmarks.kernel_table RESULTS.json: our kernels against our XLA path, from an
``ops`` results file, as the Markdown table of docs/kernels.md: forward+backward medians of
``rms_norm`` and ``add_rms_norm``, their ratio, and what ``implementation="auto"`` takes
there: the route the functions themselves take (``rmsnorm_jax.kernels.route_of``) on the
results' device and jax, from the measured wins ``"auto"`` reads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from rmsnorm_jax import add_rms_norm, kernels, rms_norm

from . import report


def auto_path(op: str, n: int, dtype: str, mib: float, target, jax_version: str) -> str:
    """``"kernels"`` where ``"auto"`` takes a backend on ``target`` (a
    ``kernels.Target``) with jax ``jax_version`` for ``mib`` MiB of whole rows, else
    ``"XLA"``."""
    rows = int(mib * 2**20) // (n * np.dtype(dtype).itemsize)
    x = jax.ShapeDtypeStruct((rows, n), jnp.dtype(dtype))
    scale = jax.ShapeDtypeStruct((n,), jnp.float32)
    args, fn = ((x, x, scale), add_rms_norm) if op == "add_rms_norm" else ((x, scale), rms_norm)
    found = kernels.route_of(fn, *args, target=target, jax_version=jax_version)
    taken = any(c.backend for p, _, c in found.choices if p == target.platform)
    return "kernels" if found.spec is not None and taken else "XLA"


def table(path: Path) -> str:
    saved = json.loads(Path(path).read_text())
    target = kernels.Target.gpu(saved["device"])
    med = {
        (r["size_mib"], r["features"], r["dtype"], r["impl"]): r["median_s"] * 1e6
        for r in saved["sections"]["ops"]["results"]
        if r["kind"] == "fwd+bwd" and r.get("status") == "ok"
    }
    shapes = sorted({k[:3] for k in med}, key=lambda k: (k[0], k[2] != "float32", k[1]))
    rows = []
    for mib, n, dtype in shapes:
        cells = [f"{mib:g}", n, dtype]
        for op in ("rms_norm", "add_rms_norm"):
            xla = med.get((mib, n, dtype, f"{op} [xla]"), med.get((mib, n, dtype, op)))
            kernel = med.get((mib, n, dtype, f"{op} [pallas]"))
            auto = auto_path(op, n, dtype, mib, target, saved["jax"])
            cells += (
                ["", "", "", ""]
                if None in (xla, kernel)
                else [f"{xla:.1f}", f"{kernel:.1f}", f"{kernel / xla:.2f}", auto]
            )
        rows.append(cells)
    head = "x MiB | features | dtype | `rms_norm` XLA us | `[pallas]` us | ratio | auto "
    head += "| `add_rms_norm` XLA us | `[pallas]` us | ratio | auto"
    return report.table(head, rows, "rrlrrrlrrrl")


if __name__ == "__main__":
    print(table(Path(sys.argv[1])))
