"""CONTRIBUTING.md's table "What proves each runtime file" stays true: every file of ``perparam/runtime/`` and
``perparam/runtime/paths/`` (``__init__.py`` aside) has one row, every row names an existing runtime file and
at least one existing test file (source and text only: nothing imported, no process)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ROOT / "perparam" / "runtime"
HEADING = "## What proves each runtime file"


def table() -> dict[str, list[str]]:
    """``{runtime file relative to perparam/runtime/: [test file names]}``, read from the table's rows."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    assert HEADING in text, f"CONTRIBUTING.md has no section {HEADING!r}"
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or not cells[0].startswith("`"):
            continue
        name = cells[0].strip("`")
        assert name not in rows, f"{name} has two rows"
        rows[name] = re.findall(r"`([^`]+)`", cells[1])
    return rows


def test_every_runtime_file_has_a_row_naming_existing_tests():
    rows = table()
    files = {p.relative_to(RUNTIME).as_posix() for p in RUNTIME.rglob("*.py") if p.name != "__init__.py"}
    assert files - rows.keys() == set(), f"runtime files without a row: {sorted(files - rows.keys())}"
    assert rows.keys() - files == set(), f"rows naming no runtime file: {sorted(rows.keys() - files)}"
    empty = [name for name, tests in rows.items() if not tests]
    assert not empty, f"rows naming no test: {empty}"
    missing = sorted({t for tests in rows.values() for t in tests
                      if not (t.startswith("test_") and (ROOT / "tests" / t).is_file())})
    assert not missing, f"test files the table names that do not exist: {missing}"
