"""Every ```python block of README.md and of every page under docs/ runs as written, so the snippets cannot
rot.

Each block is written to a file and run as its own processes (no torchrun): a 1-process gloo group by
default, or as many as its first line asks for with ``--nproc_per_node N``. A block that is deliberately a
fragment starts with ``# not run: <reason>`` and is not run (use sparingly); its calls of perparam's names
and of sharded-module or ``InvariantUnits`` methods are still checked against their signatures. A block of
Python code fenced as anything but ```python fails (it would never run, and would rot).
"""

from __future__ import annotations

import ast
import builtins
import inspect
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


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


def _fenced(lang_ok) -> list[tuple[str, int, str, str]]:
    return [(str(page.relative_to(REPO)), page.read_text()[: m.start()].count("\n") + 1, m.group(1),
             m.group(2))
            for page in pages() for m in FENCE.finditer(page.read_text()) if lang_ok(m.group(1))]


def _code(text: str) -> ast.Module | None:
    """The block parsed as Python when it is code (parses, and calls something), else ``None``."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    return tree if any(isinstance(n, ast.Call) for n in ast.walk(tree)) else None


def test_every_block_of_python_code_is_fenced_python_so_that_it_runs_or_says_why_not():
    unmarked = [f"{name}:{line} (```{lang})"
                for name, line, lang, text in _fenced(lambda lang: lang != "python")
                if _code(text)]
    assert not unmarked, ("Python code outside ```python blocks is never run; fence it ```python (a fragment "
                          f"starts with '# not run: <reason>'): {unmarked}")


def _signature_errors(tree: ast.Module) -> list[str]:
    """Calls in a fragment that cannot work as written: a perparam name that does not exist, or arguments
    its signature refuses; a method of a sharded module or of ``InvariantUnits`` that does not exist or
    refuses the arguments. Other calls (the user's objects, torch) are not checked."""
    import perparam

    kinds = {}  # a name assigned from a perparam class's constructor: that class
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            f = node.value.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if inspect.isclass(getattr(perparam, name or "", None)):
                kinds.update({t.id: getattr(perparam, name) for t in node.targets if isinstance(t, ast.Name)})
    errors = [f"{kinds[n.value.id].__name__}.{n.attr} does not exist ({n.value.id}.{n.attr})"
              for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
              and n.value.id in kinds and not _has(kinds[n.value.id], n.attr)]
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or any(isinstance(a, ast.Starred) for a in node.args) or any(
                k.arg is None for k in node.keywords):
            continue
        f, target = node.func, None
        if isinstance(f, ast.Name) and f.id in perparam.__all__:
            target = getattr(perparam, f.id)
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            owner = f.value.id
            if owner == "perparam":
                target = getattr(perparam, f.attr, None)
                if target is None:
                    errors.append(f"perparam.{f.attr} does not exist")
                    continue
            elif owner in kinds:
                target = getattr(kinds[owner], f.attr, None)
                if target is None:
                    continue  # reported above
                node = ast.Call(func=f, args=[ast.Constant(None), *node.args], keywords=node.keywords)
            elif hasattr(perparam.ShardedModule, f.attr) and not hasattr(builtins, f.attr):
                target = getattr(perparam.ShardedModule, f.attr)
                node = ast.Call(func=f, args=[ast.Constant(None), *node.args], keywords=node.keywords)
        if target is None or not callable(target):
            continue
        try:
            inspect.signature(target).bind(*node.args, **{k.arg: k.value for k in node.keywords})
        except TypeError as e:
            errors.append(f"{ast.unparse(f)}(...): {e}")
        except ValueError:  # no signature to read (a builtin)
            pass
    return errors


def _has(cls, attr: str) -> bool:
    """``cls`` has ``attr``: a class attribute, or an instance attribute its methods set (``self.attr =``)."""
    return hasattr(cls, attr) or re.search(rf"self\.{attr}\b[^=\n]*=", inspect.getsource(cls)) is not None


def test_fragments_call_perparam_names_that_exist_with_arguments_their_signatures_take():
    fragments = [(name, line, text) for name, line, _, text in _fenced(lambda lang: lang == "python")
                 if text.startswith("# not run:")]
    errors = [f"{name}:{line}: {e}" for name, line, text in fragments
              for e in _signature_errors(ast.parse(text))]
    assert not errors, errors
    # the check itself: the loop docs/invariant.md once had (none of these exist as written)
    broken = ast.parse("iu = perparam.InvariantUnits(model, units=8)\nfor u in iu.local_units: pass\n"
                       "iu.split(x, y)\nwith iu.unit(step, u, 3): pass\nmodel.set_requires_all_reduce(True, "
                       "1)")
    found = _signature_errors(broken)
    assert len(found) == 4 and "InvariantUnits.local_units does not exist" in found[0], found
    assert all(any(w in e for e in found)
               for w in ("iu.split(", "iu.unit(", "set_requires_all_reduce(")), found


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
    failed = [(r, p.returncode, o)
              for r, (p, o) in enumerate(zip(procs, outputs, strict=True)) if p.returncode]
    assert not failed, f"{page} block at line {line} failed:\n" + "\n".join(
        f"--- rank {r} (exit {c})\n{o}" for r, c, o in failed)
