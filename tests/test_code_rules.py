"""Rules of the code, read from the source (AST and text only: nothing imported, no process starts).

- **No private name crosses files.** In ``perparam/``, ``mesh/`` and ``benchmarks/`` no file imports a name
  with a leading underscore from another module of the project (``from x import _y``, ``from . import _m``)
  or reads one as an attribute of another project module (``x._y`` where ``x`` is an imported project
  module). A name two files share is public in the one file that owns it; a helper only one file uses stays
  in that file. Dunders (``__name__``) are not private. ``tests/`` may read a private name of the package
  where a test witnesses internals (a count, a cache, a seam it patches): the package is what is under test
  there. Test files and the helpers beside the harness never read each other's private names.
- **One class, one file.** A class is not split across files by inheritance: a base class of the project
  whose only subclass lives in another file, and which is never instantiated itself, is half of that
  subclass (fold it back, or make it a component the class holds). Bases that are classes in their own
  right (instantiated, several subclasses, a ``Protocol``/``ABC``) are unaffected.
- **Lines at most 110 columns** in every ``.py`` file of the four folders (ruff's E501 with
  ``line-length = 110``, ``make lint``), counted here without ruff so that the suite catches it too.

A file that is one responsibility may be as long as that responsibility is: there is no size limit.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
#: the project's code, where no private name crosses files
CODE = ("perparam", "mesh", "benchmarks")
FOLDERS = (*CODE, "tests")
MAX_COLUMNS = 110


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules(root: Path = ROOT, folders=FOLDERS) -> dict[str, Path]:
    return {module_name(p, root): p for f in folders for p in sorted((root / f).rglob("*.py"))}


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _absolute(module: str, node: ast.ImportFrom, modules: dict[str, Path]) -> str:
    if not node.level:
        return node.module or ""
    package = modules[module].name == "__init__.py"
    base = module.split(".") if package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _bound_modules(module: str, tree: ast.AST, modules: dict[str, Path]) -> dict[str, str]:
    """The names ``tree`` binds to project modules (``import a.b`` binds ``a``; ``from a import b``,
    ``b``)."""
    bound, tops = {}, {m.split(".")[0] for m in modules}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules or a.name.split(".")[0] in tops:
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node, modules)
            for a in node.names:
                if f"{source}.{a.name}" in modules:
                    bound[a.asname or a.name] = f"{source}.{a.name}"
    return bound


def private_names_across(module: str, tree: ast.AST, modules: dict[str, Path]) -> list[tuple[int, str]]:
    """``(line, what)`` for each private name of another project module that ``tree`` (the file of
    ``module``) imports or reads as a module attribute."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names
                      if a.name in modules and any(is_private(part) for part in a.name.split("."))]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node, modules)
            for a in node.names:
                sub = f"{source}.{a.name}"
                if is_private(a.name) and (sub in modules or (source in modules and source != module)):
                    found.append((node.lineno, f"from {source} import {a.name}"))
    bound = _bound_modules(module, tree, modules)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and is_private(node.attr)):
            continue
        chain, value = [], node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id in bound:
            target = ".".join([bound[value.id], *reversed(chain)])
            if target in modules and target != module:
                found.append((node.lineno, f"{ast.unparse(node)} (of {target})"))
    return sorted(set(found))


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _private_names_in(folders, modules: dict[str, Path]) -> list[str]:
    return [f"{modules[m].relative_to(ROOT)}:{line}: {what}" for m, path in modules.items()
            if m.split(".")[0] in folders for line, what in private_names_across(m, _tree(path), modules)]


def test_no_private_name_is_imported_across_the_files_of_perparam_mesh_and_benchmarks():
    wrong = _private_names_in(CODE, project_modules())
    assert not wrong, ("private names read from another file (make the name public in the file that owns it, "
                       "or move the code that uses it there):\n" + "\n".join(wrong))


def test_test_files_read_no_private_name_of_another_test_file():
    modules = project_modules()
    tests = {m: p for m, p in modules.items() if m.split(".")[0] == "tests"}
    wrong = [w for w in _private_names_in(("tests",), modules) if "tests." in w.split(": ", 1)[1]]
    assert tests and not wrong, ("a private name shared between test files (make it public):\n"
                                 + "\n".join(wrong))


def test_the_private_name_reader_sees_every_spelling(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "b.py").write_text("_x = 1\n")
    (tmp_path / "pkg" / "_c.py").write_text("")
    source = ("from .b import _x, y\nfrom . import b, _c\nimport pkg.b\nimport pkg.b as "
              "bee\nb._z()\nb.__name__\npkg.b._w\nbee._v\nobj._u\n")
    (tmp_path / "pkg" / "a.py").write_text(source)
    modules = project_modules(tmp_path, ("pkg",))
    found = [what for _, what in private_names_across("pkg.a", ast.parse(source), modules)]
    assert sorted(found) == sorted(["from pkg.b import _x", "from pkg import _c", "b._z (of pkg.b)",
                                    "pkg.b._w (of pkg.b)", "bee._v (of pkg.b)"]), found


# -- one class, one file ---------------------------------------------------------------------------------
class _Class:
    def __init__(self, module: str, node: ast.ClassDef) -> None:
        self.module, self.node, self.name = module, node, node.name
        self.subclasses: list[tuple[str, str]] = []  # (module, name)


def _classes(modules: dict[str, Path]) -> tuple[dict[tuple[str, str], _Class], dict[str, ast.AST]]:
    trees = {m: _tree(p) for m, p in modules.items()}
    classes = {(m, n.name): _Class(m, n) for m, t in trees.items() for n in ast.walk(t)
               if isinstance(n, ast.ClassDef)}
    return classes, trees


def _resolve(module: str, tree: ast.AST, name: str, modules, classes) -> tuple[str, str] | None:
    """The project class ``name`` means in ``module`` (its own, or imported by name), or ``None``."""
    if (module, name) in classes:
        return module, name
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _absolute(module, node, modules)
            for a in node.names:
                if (a.asname or a.name) == name and (source, a.name) in classes:
                    return source, a.name
    return None


def split_classes(modules: dict[str, Path]) -> list[str]:
    """``base (file) <- subclass (file)`` for each project class subclassed once, in another file, and never
    instantiated (nor a ``Protocol``/``ABC``)."""
    classes, trees = _classes(modules)
    called = {ast.unparse(n.func).split(".")[-1] for t in trees.values() for n in ast.walk(t)
              if isinstance(n, ast.Call)}
    for (module, _), cls in classes.items():
        bound = _bound_modules(module, trees[module], modules)
        for base in cls.node.bases:
            if isinstance(base, ast.Name):
                target = _resolve(module, trees[module], base.id, modules, classes)
            elif (isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name)
                  and base.value.id in bound):
                target = ((bound[base.value.id], base.attr) if (bound[base.value.id], base.attr) in classes
                          else None)
            else:
                target = None
            if target is not None:
                classes[target].subclasses.append((module, cls.name))
    wrong = []
    for (module, name), cls in classes.items():
        interface = any(ast.unparse(b).split(".")[-1] in ("Protocol", "ABC") for b in cls.node.bases)
        elsewhere = [s for s in cls.subclasses if s[0] != module]
        if len(cls.subclasses) == 1 and elsewhere and name not in called and not interface:
            wrong.append(f"{name} ({module}) <- {elsewhere[0][1]} ({elsewhere[0][0]})")
    return wrong


def test_no_class_is_split_across_files_by_base_class():
    wrong = split_classes(project_modules(ROOT, CODE))
    assert not wrong, ("a base class that is half of its only subclass, in another file (fold it into the "
                       "class, or make it a component the class holds):\n" + "\n".join(wrong))


def test_the_class_reader_sees_a_split_and_leaves_real_bases_alone(tmp_path):
    (tmp_path / "pkg").mkdir()
    files = {"__init__.py": "", "half.py": "class Settings:\n    pass\n\nclass Error(Exception):\n    pass\n",
             "whole.py": "from .half import Settings, Error\n\nclass Module(Settings):\n    pass\n\n"
                         "class Refused(Error):\n    pass\n\nraise Error('x')\n",
             "proto.py": "from typing import Protocol\n\nclass Path(Protocol):\n    pass\n",
             "impl.py": "from . import proto\n\nclass Packed(proto.Path):\n    pass\n"}
    for name, text in files.items():
        (tmp_path / "pkg" / name).write_text(text)
    assert split_classes(project_modules(tmp_path, ("pkg",))) == ["Settings (pkg.half) <- Module (pkg.whole)"]


# -- line length -----------------------------------------------------------------------------------------
def long_lines(text: str, limit: int = MAX_COLUMNS) -> list[int]:
    """The 1-based numbers of the lines of ``text`` longer than ``limit`` characters."""
    return [i for i, line in enumerate(text.splitlines(), 1) if len(line) > limit]


def test_no_line_is_longer_than_110_columns():
    wrong = [f"{p.relative_to(ROOT)}:{i}" for p in project_modules().values()
             for i in long_lines(p.read_text())]
    assert not wrong, (f"{len(wrong)} lines over {MAX_COLUMNS} columns (wrap them by hand):\n"
                       + "\n".join(wrong))


def test_ruff_is_told_to_check_the_line_length():
    text = (ROOT / "pyproject.toml").read_text()
    assert f"line-length = {MAX_COLUMNS}" in text
    ignore = next(line for line in text.splitlines() if line.startswith("ignore"))
    assert "E501" not in ignore, ignore
