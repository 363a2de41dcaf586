"""The numbers of the README, docs/ and the notebook, read back from the committed results
files they come from: a number that a results file no longer gives fails here.

Two ways a page ties a number to its file:

- a table right below ``<!-- rows from PATH -->`` (an HTML comment, invisible on the
  rendered page) copies rows of the results file ``PATH``: each of its rows with a digit
  must be a row of that file, verbatim;
- a claim below (``CLAIMS``): a sentence of a page with its numbers left as ``{names}``,
  the results files, and how each number follows from them (a range over several runs
  where the number depends on the machine). The page must hold the sentence with the
  numbers the files give (whitespace aside) and name the files' directory.

Results files: ``benchmarks/results/`` (``benchmarks/results/README.md`` gives each one's
command and commit) and ``examples/results/`` (``examples/reproduce.py``; each file holds
its command, commit, Python, versions and machine).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = "benchmarks/results"
EXAMPLE = "examples/results"
ROWS_FROM = re.compile(r"^<!-- rows from (\S+) -->$")


def _load(*patterns: str) -> list[dict]:
    """Every JSON file under ROOT matching one of ``patterns``, in their order (each
    pattern's files in name order)."""
    files = []
    for pattern in patterns:
        paths = sorted(ROOT.glob(pattern))
        assert paths, f"no results file matches {pattern}"
        files += [json.loads(p.read_text()) for p in paths]
    return files


def _span(values, fmt: str, sep: str = "-") -> str:
    """``min-max`` of ``values`` in ``fmt``; one value where both format alike."""
    low, high = format(min(values), fmt), format(max(values), fmt)
    return low if low == high else f"{low}{sep}{high}"


def _normalised(text: str) -> str:
    return " ".join(text.split())


@dataclasses.dataclass(frozen=True)
class Claim:
    page: str
    text: str  # as on the page, with {name} for each number
    sources: tuple[str, ...]  # globs of results files under ROOT
    values: Callable[[list[dict]], dict[str, str]]

    @property
    def id(self) -> str:
        return f"{self.page}: {self.text[:50]}"


# ---------------------------------------------------------------- XLA:CPU (docs/cpu.md)


def _cpu_results(files):
    (saved,) = files
    at = {(r["impl"], r["features"], r["dtype"]): r for r in saved["results"]}
    shapes = sorted({(f, d) for _, f, d in at})
    return at, shapes


def _cpu_speedups(files):
    at, shapes = _cpu_results(files)

    def over_flax(impl, dtypes=("float32", "bfloat16")):
        return [at[(impl, f, d)]["speedup_vs_flax"] for f, d in shapes if d in dtypes]

    def ours_over(peers):
        return [
            at[("rms_norm", f, d)]["fwd_bwd_s"] / min(at[(p, f, d)]["fwd_bwd_s"] for p in peers)
            for f, d in shapes
        ]

    return {
        "all": _span(over_flax("rms_norm"), ".1f", "x to "),
        "bf16": _span(over_flax("rms_norm", ("bfloat16",)), ".1f", "x to "),
        "plain": _span(ours_over(["jnp + autodiff"]), ".2f"),
        "best": _span(ours_over(["flax RMSNorm", "flax LayerNorm", "jnp + autodiff"]), ".2f"),
        "p1": _span(over_flax("rms_norm"), ".2f"),
        "p0625": _span(over_flax("rms_norm p=0.0625"), ".2f"),
        "traffic256": f"{1e3 * at[('baseline', 256, 'bfloat16')]['fwd_bwd_s']:.0f}",
        "traffic1024": f"{1e3 * at[('baseline', 1024, 'bfloat16')]['fwd_bwd_s']:.0f}",
    }


# ---------------------------------------------------------------- estimates


def _whole_step(files):
    """docs/estimates.md's whole-step table: the peers' estimate over ours, per target."""
    cells = {}
    for saved in files:
        by = {(r["dtype"], r["norm"]): r["vs_ours"] for r in saved["step_cost"]}
        for dtype in ("float32", "bfloat16"):
            cells[f"{saved['target'].split(':')[0]} {dtype}"] = ", ".join(
                f"{by[(dtype, peer)]:.3f}"
                for peer in ("flax RMSNorm", "flax LayerNorm", "jnp + autodiff")
            )
    return {
        f"{target.replace('-', '_')}_{dtype}": value
        for (target, dtype), value in ((k.split(), v) for k, v in cells.items())
    }


def _h100_step(files):
    (saved,) = files
    by = {(r["dtype"], r["norm"]): r for r in saved["step_cost"]}
    out = {}
    for dtype in ("float32", "bfloat16"):
        out[f"ours_{dtype}"] = f"{by[(dtype, 'rms_norm')]['step']:,.0f}"
        for key, peer in (
            ("rms", "flax RMSNorm"),
            ("ln", "flax LayerNorm"),
            ("plain", "jnp + autodiff"),
        ):
            out[f"{key}_{dtype}"] = f"{by[(dtype, peer)]['minus_ours']:+.0f}"
    return out


CLAIMS = [
    Claim(
        "docs/cpu.md",
        "Forward+backward is {all} faster than `flax.linen.RMSNorm` on every shape and dtype "
        "({bf16} in bfloat16)",
        (f"{BENCH}/results.json",),
        lambda f: {k: v + "x" for k, v in _cpu_speedups(f).items() if k in ("all", "bf16")},
    ),
    Claim(
        "docs/cpu.md",
        "against the plain formula under autodiff it takes {plain}x the time, and {best}x "
        "the best of flax RMSNorm, flax LayerNorm and the plain formula",
        (f"{BENCH}/results.json",),
        _cpu_speedups,
    ),
    Claim(
        "docs/cpu.md",
        "(the traffic baseline took {traffic256} ms at 256 bfloat16 features and "
        "{traffic1024} ms at 1024)",
        (f"{BENCH}/results.json",),
        _cpu_speedups,
    ),
    Claim(
        "docs/cpu.md",
        "Its forward+backward is {p0625}x faster than flax's (the table's middle speed-up), "
        "against {p1}x for p = 1.",
        (f"{BENCH}/results.json",),
        _cpu_speedups,
    ),
    Claim(
        "docs/estimates.md",
        "| H100 | {h100_float32} | {h100_bfloat16} | "
        "| TPU v5e | {tpu_v5e_float32} | {tpu_v5e_bfloat16} | "
        "| TPU v6e | {tpu_v6e_float32} | {tpu_v6e_bfloat16} |",
        (f"{BENCH}/h100.json", f"{BENCH}/tpu-v5e_2x2.json", f"{BENCH}/tpu-v6e_2x2.json"),
        _whole_step,
    ),
    Claim(
        "docs/estimates.md",
        "`rms_norm` {ours_float32} in float32 and {ours_bfloat16} in bfloat16; flax RMSNorm "
        "{rms_float32} and {rms_bfloat16}; flax LayerNorm {ln_float32} and {ln_bfloat16}; "
        "plain autodiff {plain_float32} and {plain_bfloat16})",
        (f"{BENCH}/h100.json",),
        _h100_step,
    ),
]


@pytest.mark.parametrize("claim", CLAIMS, ids=lambda c: c.id)
def test_claim_reads_back_from_its_results(claim):
    page = (ROOT / claim.page).read_text()
    expected = claim.text.format(**claim.values(_load(*claim.sources)))
    assert _normalised(expected) in _normalised(page), (
        f"{claim.page} should say, from {', '.join(claim.sources)}:\n  {expected}"
    )
    for source in claim.sources:
        directory, name = source.rsplit("/", 1)
        assert directory in page or name in page, f"{claim.page} quotes {source} unnamed"


def _tables_from_results() -> list[tuple[str, int, str, list[str]]]:
    """(page, line, results file, the table's rows) for each ``<!-- rows from -->``."""
    found = []
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            match = ROWS_FROM.match(line.strip())
            if not match:
                continue
            start = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("|"))
            end = next((j for j in range(start, len(lines)) if not lines[j].startswith("|")), None)
            rows = lines[start : end or len(lines)]
            found.append((page.relative_to(ROOT).as_posix(), i + 1, match.group(1), rows))
    return found


TABLES = _tables_from_results()


def test_pages_mark_the_tables_they_copy():
    marked = {(page, source) for page, _, source, _ in TABLES}
    assert (("docs/cpu.md", f"{BENCH}/summary.md")) in marked
    assert {
        ("docs/estimates.md", f"{BENCH}/{t}-summary.md")
        for t in ("h100", "tpu-v5e_2x2", "tpu-v6e_2x2")
    } <= marked


@pytest.mark.parametrize("page, line, source, rows", TABLES, ids=lambda v: str(v)[:40])
def test_table_rows_are_rows_of_their_results_file(page, line, source, rows):
    path = ROOT / source
    assert path.is_file(), f"{page}:{line} names {source}, which does not exist"
    known = {row.strip() for row in path.read_text().splitlines() if row.startswith("|")}
    numbered = [r for r in rows if re.search(r"\d", r) and not re.fullmatch(r"[|\-: ]+", r)]
    assert numbered, f"{page}:{line}: no numbers under the marker"
    missing = [r for r in numbered if r.strip() not in known]
    assert not missing, f"{page}:{line}: rows not in {source}:\n" + "\n".join(missing)


def test_a_wrong_number_fails():
    """The checks can fail: a claim whose page says something else, and a row changed."""
    claim = dataclasses.replace(CLAIMS[0], text=CLAIMS[0].text.replace("faster", "slower"))
    with pytest.raises(AssertionError, match="should say"):
        test_claim_reads_back_from_its_results(claim)
    page, line, source, rows = next(t for t in TABLES if t[0] == "docs/cpu.md")
    changed = [rows[0], rows[1], rows[2].replace("|", "| 9", 1), *rows[3:]]
    with pytest.raises(AssertionError, match="rows not in"):
        test_table_rows_are_rows_of_their_results_file(page, line, source, changed)
