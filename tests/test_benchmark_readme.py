"""Every benchmark is run as ``python -m benchmarks.<name>`` and named so in ``benchmarks/README.md``, and
every command or benchmark file the repository's pages and docstrings name exists (source text only: nothing
is imported, no process starts)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
README = BENCHMARKS / "README.md"
COMMAND = re.compile(r"-m (benchmarks(?:\.\w+)+)")
FILE = re.compile(r"\bbenchmarks/[\w/]+\.py\b")
#: a benchmark started as a file, which would run without the repository root on ``sys.path``
AS_FILE = re.compile(r"(?:python|\$\(PY\))\S* benchmarks/\w")


def _runnable(path: Path) -> bool:
    """The file has an ``if __name__ == "__main__":`` block."""
    return any(isinstance(n, ast.If) and "__name__" in ast.unparse(n.test)
               and "__main__" in ast.unparse(n.test)
               for n in ast.parse(path.read_text()).body)


def benchmark_modules() -> list[str]:
    """The runnable modules under benchmarks/, dotted."""
    return sorted(".".join(p.relative_to(REPO).with_suffix("").parts)
                  for p in BENCHMARKS.rglob("*.py") if _runnable(p))


def pages() -> list[Path]:
    """Where commands are written: the READMEs, CONTRIBUTING, docs/, the Makefile, and the Python sources
    (docstrings and messages) of perparam/, benchmarks/ and tests/ (this file's examples aside)."""
    return [REPO / "README.md", README, REPO / "CONTRIBUTING.md", REPO / "Makefile",
            *sorted((REPO / "docs").glob("*.md")),
            *(p for d in ("perparam", "benchmarks", "tests") for p in sorted((REPO / d).rglob("*.py"))
              if p != Path(__file__).resolve())]


def test_every_benchmark_is_a_command_of_the_benchmarks_readme():
    written = set(COMMAND.findall(README.read_text()))
    missing = [m for m in benchmark_modules() if m not in written]
    assert not missing, f"benchmarks/README.md has no `python -m <module>` for: {missing}"


def test_every_benchmark_command_and_file_named_exists():
    wrong = []
    for page in pages():
        text = page.read_text()
        for line_no, line in enumerate(text.splitlines(), 1):
            for module in COMMAND.findall(line):
                if not (REPO / Path(*module.split("."))).with_suffix(".py").exists():
                    wrong.append(f"{page.relative_to(REPO)}:{line_no}: python -m {module}")
            for path in FILE.findall(line):
                if not (REPO / path).exists():
                    wrong.append(f"{page.relative_to(REPO)}:{line_no}: {path}")
    assert not wrong, "commands or files that do not exist:\n" + "\n".join(wrong)


def test_benchmarks_are_started_as_modules_everywhere():
    wrong = [f"{page.relative_to(REPO)}:{i}: {line.strip()}" for page in pages()
             for i, line in enumerate(page.read_text().splitlines(), 1) if AS_FILE.search(line)]
    assert not wrong, ("start a benchmark as `python -m benchmarks.<name>` from the repository root:\n"
                       + "\n".join(wrong))


def test_the_readers_see_a_missing_command_and_a_file_started_as_a_script():
    assert COMMAND.findall("python -m benchmarks.gpu.check --json x; python -m benchmarks.step_time") == [
        "benchmarks.gpu.check", "benchmarks.step_time"]
    assert FILE.findall("see `benchmarks/harness/model.py` and benchmarks/README.md") == [
        "benchmarks/harness/model.py"]
    assert AS_FILE.search("PYTHONPATH=. python benchmarks/offload_step.py --dir /tmp")
    assert AS_FILE.search("\t$(PY) benchmarks/step_time.py --json x")
    assert not AS_FILE.search("python -m benchmarks.step_time")
