"""python -m benchmarks.kernel_table RESULTS.json: the kernels against the XLA path, as a
Markdown table (docs/kernels.md and the README print it from the committed H200 run).

One row per shape of ``python -m benchmarks ops``: forward+backward device time of
``rms_norm`` and ``add_rms_norm`` on the XLA path and with ``implementation="pallas"``,
their ratio, and whether ``"auto"`` takes the kernels there (``kernels.MEASURED``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np

from rmsnorm_jax.kernels import _dispatch
from rmsnorm_jax.kernels._spec import KernelSpec


def _medians(path: Path) -> dict:
    rows = json.loads(Path(path).read_text())["sections"]["ops"]["results"]
    return {
        (r["size_mib"], r["features"], r["dtype"], r["impl"]): r["median_s"] * 1e6
        for r in rows
        if r["kind"] == "fwd+bwd" and r.get("status") == "ok"
    }


def _auto(op: str, n: int, dtype: str, mib: float, device_kind: str) -> bool:
    spec = KernelSpec(n, n, 1e-6, True, 0.0, True, False, np.dtype(dtype))
    x = jax.ShapeDtypeStruct((int(mib * 2**20) // (n * np.dtype(dtype).itemsize), n), dtype)
    return _dispatch.measured_win(op, spec, x, device=("cuda", device_kind)) is not None


def table(path: Path, device_kind: str = "NVIDIA H200") -> str:
    med = _medians(path)
    shapes = sorted({k[:3] for k in med}, key=lambda k: (k[0], k[2] != "float32", k[1]))
    out = [
        "| x MiB | features | dtype | `rms_norm` XLA us | `[pallas]` us | ratio | auto "
        "| `add_rms_norm` XLA us | `[pallas]` us | ratio | auto |",
        "|---:|---:|---|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for mib, n, dtype in shapes:
        cells = [f"{mib:g}", str(n), dtype]
        for op in ("rms_norm", "add_rms_norm"):
            xla, kernel = med.get((mib, n, dtype, op)), med.get((mib, n, dtype, f"{op} [pallas]"))
            if xla is None or kernel is None:
                cells += ["", "", "", ""]
                continue
            auto = "kernels" if _auto(op, n, dtype, mib, device_kind) else "XLA"
            cells += [f"{xla:.1f}", f"{kernel:.1f}", f"{kernel / xla:.2f}", auto]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    print(table(Path(sys.argv[1])))
