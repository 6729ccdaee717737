"""Every ```python block of README.md and of every page under docs/ runs as written, so the snippets cannot
rot.

Each block is written to a file and run as its own processes (no torchrun): a 1-process gloo group by
default, or as many as its first line asks for with ``--nproc_per_node N``. A block that is deliberately a
fragment starts with ``# not run: <reason>`` and is skipped (use sparingly).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def pages() -> list[Path]:
    """README.md and every markdown page under docs/."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def python_blocks() -> list[tuple[str, int, str]]:
    """``(page, line, code)`` of every ```python block, ``page`` relative to the repository."""
    blocks = []
    for page in pages():
        text = page.read_text()
        name = str(page.relative_to(REPO))
        blocks += [(name, text[: m.start()].count("\n") + 1, m.group(1)) for m in BLOCK.finditer(text)]
    return blocks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_readme_and_the_docs_have_python_blocks():
    names = {name for name, _, _ in python_blocks()}
    assert "README.md" in names and len(names) >= 4, names
    assert len(pages()) >= 8  # README and the docs pages it links


def test_every_page_the_readme_links_exists_and_is_read_here():
    """The README's links to docs/ name pages that exist, and each of those pages' blocks are among the ones
    run below."""
    linked = set(re.findall(r"\]\((docs/[\w-]+\.md)", (REPO / "README.md").read_text()))
    present = {str(p.relative_to(REPO)) for p in pages()}
    assert linked <= present, linked - present


@pytest.mark.parametrize("page, line, code", python_blocks(),
                         ids=[f"{name}:{line}" for name, line, _ in python_blocks()])
def test_readme_python_block_runs(tmp_path, page, line, code):
    first = code.splitlines()[0] if code.strip() else ""
    if first.startswith("# not run:"):
        pytest.skip(first)
    nproc = int(m.group(1)) if (m := re.search(r"--nproc_per_node (\d+)", first)) else 1
    script = tmp_path / f"{Path(page).stem}_line{line}.py"
    script.write_text(code)
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    procs = [subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc)})
             for r in range(nproc)]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=120)
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    failed = [(r, p.returncode, o) for r, (p, o) in enumerate(zip(procs, outputs, strict=True)) if p.returncode]
    assert not failed, f"{page} block at line {line} failed:\n" + "\n".join(
        f"--- rank {r} (exit {c})\n{o}" for r, c, o in failed)
