"""CONTRIBUTING.md stays true as a guide: its map of the tests names every ``tests/test_*.py`` file and no
file that does not exist, every file of ``perparam/runtime/`` is named by a row of the map (the tests that
prove it), every path the guide names exists, and every table row stays under 400 characters (source and
text only: nothing imported, no process)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "CONTRIBUTING.md"
MAP_HEADING = "## Map of the tests"
MAX_ROW = 400
#: where a path written relative to a folder is looked up, in order (``runtime/hooks.py``,
#: ``paths/choose.py``)
BASES = ("", "perparam", "perparam/runtime", "tests", "benchmarks")
#: named by the guide but made by a command, never committed (git-ignored)
MADE_BY_COMMANDS = {".cache/assets/": "downloaded by `make test`"}
FILE = re.compile(r"\.(py|md|toml|txt|json|png|cfg)$")


def text() -> str:
    return GUIDE.read_text()


def map_rows(guide: str) -> list[list[str]]:
    """The cells of every table row of the section "Map of the tests"."""
    assert MAP_HEADING in guide, f"CONTRIBUTING.md has no section {MAP_HEADING!r}"
    section = guide.split(MAP_HEADING, 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| `")]
    return rows


def named_paths(guide: str) -> set[str]:
    """What the guide names as a file or folder: code spans and link targets that hold a ``/`` or end in a
    file suffix, without spaces, options (``--lora/--qlora``) or placeholders (``benchmarks/<name>.py``)."""
    spans = re.findall(r"`([^`\n]+)`", guide) + re.findall(r"\]\(([^)#\s]+)", guide)
    return {s for s in spans
            if " " not in s and not s.startswith(("-", "/", "http")) and "<" not in s
            and ("/" in s or FILE.search(s)) and not re.search(r"[=(),'\"]", s)}


def exists(path: str) -> bool:
    if "*" in path:
        return any(any((ROOT / base).glob(path)) for base in BASES)
    if "/" not in path.rstrip("/"):  # a bare file name: somewhere in the repository
        return any(p for p in ROOT.rglob(path) if ".venv" not in p.parts and ".git" not in p.parts)
    return any((ROOT / base / path).exists() for base in BASES)


def test_the_map_names_every_test_file_once_and_no_other():
    named = [row[0].strip("`") for row in map_rows(text())]
    files = sorted(p.name for p in (ROOT / "tests").glob("test_*.py"))
    assert sorted(set(files) - set(named)) == [], "test files missing from CONTRIBUTING's map of the tests"
    assert sorted(set(named) - set(files)) == [], "the map names test files that do not exist"
    assert sorted({n for n in named if named.count(n) > 1}) == [], "test files with two rows in the map"


def test_every_runtime_file_is_named_by_the_tests_that_prove_it():
    named = {m for row in map_rows(text()) for m in re.findall(r"`runtime/([^`]+\.py)`", row[1])}
    runtime = ROOT / "perparam" / "runtime"
    files = {p.relative_to(runtime).as_posix() for p in runtime.rglob("*.py") if p.name != "__init__.py"}
    assert sorted(files - named) == [], "runtime files no row of the map names (`runtime/<file>`)"
    assert sorted(named - files) == [], "the map names runtime files that do not exist"


def test_every_path_the_guide_names_exists():
    missing = sorted(p for p in named_paths(text()) if p not in MADE_BY_COMMANDS and not exists(p))
    assert missing == [], f"CONTRIBUTING.md names paths that do not exist: {missing}"


def test_the_path_reader_sees_spans_links_and_globs_and_skips_options():
    sample = ("`perparam/api.py`, [docs/x.md](docs/x.md), `tests/test_*.py`, `choose.py`, `--lora/--qlora`, "
              "`benchmarks/<name>.py`, `perparam.hf_trainer`, `python -m benchmarks.step_time`")
    assert named_paths(sample) == {"perparam/api.py", "docs/x.md", "tests/test_*.py", "choose.py"}
    assert exists("tests/test_*.py") and exists("runtime/hooks.py") and exists("choose.py")
    assert not exists("perparam/no_such_file.py")


def test_every_table_row_is_under_400_characters():
    long = [f"{len(line)}: {line[:60]}..." for line in text().splitlines()
            if line.startswith("|") and len(line) >= MAX_ROW]
    assert long == [], f"table rows of {MAX_ROW} characters or more: {long}"
