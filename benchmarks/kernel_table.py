"""python -m benchmarks.kernel_table RESULTS.json: our kernels against our XLA path, from an
``ops`` results file, as the Markdown table of docs/kernels.md: forward+backward medians of
``rms_norm`` and ``add_rms_norm``, their ratio, and whether ``"auto"`` takes the kernels
there (``rmsnorm_jax.kernels.MEASURED``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from rmsnorm_jax import kernels

from . import report


def auto_takes_kernels(op: str, n: int, dtype: str, mib: float, device_kind: str) -> bool:
    """Whether a ``MEASURED`` win covers this call on a CUDA device of ``device_kind``."""
    x_bytes = int(mib * 2**20) // (n * np.dtype(dtype).itemsize) * n * np.dtype(dtype).itemsize
    return any(
        m.op == op and m.platform == "cuda" and m.device_kind in device_kind and dtype in m.dtypes
        and m.features[0] <= n <= m.features[1] and x_bytes >= m.min_bytes
        for m in kernels.MEASURED
    )  # fmt: skip


def table(path: Path, device_kind: str = "NVIDIA H200") -> str:
    saved = json.loads(Path(path).read_text())
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
            auto = "kernels" if auto_takes_kernels(op, n, dtype, mib, device_kind) else "XLA"
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
