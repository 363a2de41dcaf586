"""The measured wins of the kernels over XLA that ``implementation="auto"`` acts on.

They are data, ``data/measured_wins.json``: each names what it holds for (op, platform,
device kind, dtypes, widths, the smallest ``x``, the jax versions) and where it was
measured (results file, command, commit). :func:`match` is the one reading of them: the
selection (``_select.py``), ``explain``, ``benchmarks/kernel_table.py`` and the docs'
tables all go through it.
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources

_DATA = "data/measured_wins.json"


@dataclasses.dataclass(frozen=True)
class Measurement:
    """A measured win of one backend's kernels over the XLA path.

    Attributes:
      op: ``"rms_norm"`` or ``"add_rms_norm"``: the function whose kernels won.
      backend: the kernels that won: ``"triton"``, ``"mosaic_gpu"`` or ``"mosaic_tpu"``.
      platform: ``"cuda"`` or ``"tpu"`` (``lax.platform_dependent``'s names).
      device_kind: a substring of ``jax.Device.device_kind`` (e.g. ``"H200"``).
      dtypes: the input dtype names it holds for.
      features: the inclusive range of features per row it holds for.
      smallest_bytes: the smallest ``x`` (bytes) measured; smaller calls stay on XLA.
      jax: the jax versions it holds for: ``"0.11.2"`` is that release, ``"0.11"`` any
        0.11 release.
      results: the results file that holds the measurement.
      command: the command that wrote it.
      commit: the project's head it measured.
      measured: what the run timed, in words.
      ground: why the range reaches past the measured shapes, where it does.
    """

    op: str
    backend: str
    platform: str
    device_kind: str
    dtypes: tuple[str, ...]
    features: tuple[int, int]
    smallest_bytes: int
    jax: tuple[str, ...]
    results: str
    command: str
    commit: str
    measured: str = ""
    ground: str | None = None

    @property
    def source(self) -> str:
        """Where it was measured, in one line."""
        return f"{self.results}, `{self.command}` at {self.commit}, jax {', '.join(self.jax)}"

    def holds_for_jax(self, version: str) -> bool:
        return any(version == v or version.startswith(v + ".") for v in self.jax)


def load(text: str) -> tuple[Measurement, ...]:
    """The wins in a ``measured_wins.json`` text."""
    wins = []
    for entry in json.loads(text)["wins"]:
        fields = dict(entry)
        for name in ("dtypes", "features", "jax"):
            fields[name] = tuple(fields[name])
        wins.append(Measurement(**fields))
    return tuple(wins)


MEASURED: tuple[Measurement, ...] = load(resources.files(__package__).joinpath(_DATA).read_text())


def match(
    op: str,
    platform: str,
    device_kind: str,
    dtype: str,
    features: int,
    x_bytes: int,
    jax_version: str,
    wins: tuple[Measurement, ...] | None = None,
) -> tuple[Measurement | None, str]:
    """The win that covers a call, or None; and, for None, what no win covers.

    ``wins``: by default :data:`MEASURED`. A win covers the call where every one of its
    conditions holds: op, platform, a device kind containing its ``device_kind``, the
    input dtype, the features in its range, ``x_bytes`` at least its smallest, and the
    installed jax among its versions.
    """
    candidates = MEASURED if wins is None else wins
    shaped = [
        m
        for m in candidates
        if m.op == op
        and m.platform == platform
        and m.device_kind in device_kind
        and dtype in m.dtypes
        and m.features[0] <= features <= m.features[1]
        and x_bytes >= m.smallest_bytes
    ]
    for m in shaped:
        if m.holds_for_jax(jax_version):
            return m, ""
    call = f"{op} on {device_kind} ({platform}), {dtype}, {features} features, {x_bytes:,} bytes"
    if shaped:
        versions = sorted({v for m in shaped for v in m.jax})
        return (
            None,
            f"the wins for {call} were measured on jax {', '.join(versions)}, not {jax_version}",
        )
    return None, f"no measured win covers {call}"
