"""The README and the docs/ pages: their python blocks run, their links resolve, the README
stays short and leads with what a user decides on, and .ci/run runs its test command.

Each page's python blocks run in order in one namespace of their own (the README's too). A
block whose first line is ``# not run: <reason>`` is not run (for code that needs an
accelerator); ``test_blocks_not_run_are_reported`` lists every such block as a skip reason,
so that ``pytest -ra`` shows them.
"""

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_PATH = ROOT / "README.md"
README = README_PATH.read_text()
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README_PATH, *DOCS]
MAX_README_LINES = 250
NOT_RUN = "# not run:"
# [text](target) and ![alt](target); the target up to the first space or ")".
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _name(path):
    return path.relative_to(ROOT).as_posix()


def _blocks(text, lang):
    """The fenced ``lang`` blocks of ``text``: (line of the block's first code line, code)."""
    return [
        (text.count("\n", 0, m.start(1)) + 1, m.group(1))
        for m in re.finditer(rf"```{lang}\n(.*?)```", text, flags=re.S)
    ]


def _not_run_reason(code):
    """The reason after ``# not run:`` when the block opts out, else None."""
    first = code.lstrip("\n").splitlines()[0] if code.strip() else ""
    return first[len(NOT_RUN) :].strip() if first.startswith(NOT_RUN) else None


def _relative_links(text):
    """Links that point into the repository (no scheme): (path, anchor); path "" is this page."""
    links = []
    for target in LINK.findall(text):
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target):
            path, _, anchor = target.partition("#")
            links.append((path, anchor))
    return links


def _anchors(text):
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return {
        re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)
    }


def test_readme_starts_with_the_two_commands():
    (_, first), (_, second) = _blocks(README, "bash")[:2]
    assert "examples/train_lm.py" in first and "pip install" in first
    assert "pytest" in second and '".[test]"' in second
    assert README.index(first) < README.index("## ")


def test_ci_runs_the_readme_test_command():
    command = _blocks(README, "bash")[1][1].strip().splitlines()[-1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "README.md" in ci and "Install and run the tests" in ci
    assert command.startswith("python3 -m venv .venv")


def test_readme_is_short():
    lines = len(README.splitlines())
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines, more than {MAX_README_LINES}: move the deep material "
        "into a docs/ page and link it."
    )


def test_readme_first_sections_are_at_a_glance_then_quickstart():
    sections = re.findall(r"^## (.+)$", README, flags=re.M)
    assert sections[:2] == ["At a glance", "Quickstart"], sections[:2]


def test_readme_links_every_docs_page_and_each_exists():
    linked = {p for p, _ in _relative_links(README) if p.startswith("docs/") and p.endswith(".md")}
    missing = sorted(t for t in linked if not (ROOT / t).is_file())
    assert not missing, f"README.md links docs pages that do not exist: {missing}"
    unlinked = sorted({_name(p) for p in DOCS} - linked)
    assert not unlinked, f"docs pages that README.md does not link: {unlinked}"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_relative_links_resolve(page):
    broken = []
    for path, anchor in _relative_links(page.read_text()):
        target = page.parent / path if path else page
        if not target.exists():
            broken.append(path)
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target.read_text()):
            broken.append(f"{path}#{anchor}")
    assert not broken, f"{_name(page)} links paths or headings that do not exist: {broken}"


@pytest.fixture
def restore_environ():
    """A page may set os.environ (JAX_PLATFORMS before importing jax): undo it afterwards,
    so that later tests, and the subprocesses they start, see the environment unchanged."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize("page", [p for p in PAGES if _blocks(p.read_text(), "python")], ids=_name)
def test_python_blocks_run(page, restore_environ):
    text = page.read_text()
    namespace = {"__name__": f"docs_{page.stem}"}
    ran = 0
    for line, code in _blocks(text, "python"):
        if _not_run_reason(code) is not None:
            continue
        # Padding keeps the page's own line numbers in a traceback.
        exec(compile("\n" * (line - 1) + code, str(page), "exec"), namespace)
        ran += 1
    if page == README_PATH:
        assert ran >= 3, "the README's quickstart and migration blocks must run"


def test_blocks_not_run_are_reported():
    skipped = []
    for page in PAGES:
        for line, code in _blocks(page.read_text(), "python"):
            reason = _not_run_reason(code)
            if reason is None:
                continue
            assert reason, f"{_name(page)}:{line}: '{NOT_RUN}' needs a reason after the colon"
            skipped.append(f"{_name(page)}:{line} ({reason})")
    if skipped:
        pytest.skip(f"python blocks not run: {'; '.join(skipped)}")


MACHINE_PATH = re.compile(r"(?<![\w.])/(?:tmp|work|root|home|Users|opt|mnt|var|usr)/")


PAGES_AND_NOTEBOOK = [
    "README.md",
    "CHANGELOG.md",
    *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")),
    "notebooks/rmsnorm_tour.ipynb",
]


@pytest.mark.parametrize("path", PAGES_AND_NOTEBOOK)
def test_no_page_names_a_folder_of_the_machine_that_wrote_it(path):
    """The docs, and the notebook's stored outputs, say which Python and jax, never a
    folder of one machine (the results files: tests/bench/test_bench.py)."""
    text = (ROOT / path).read_text()
    found = MACHINE_PATH.search(text)
    assert not found, f"{path}: {text[max(0, found.start() - 60) : found.end() + 40]!r}"
