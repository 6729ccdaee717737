"""The package's layers, read from the source (AST only: nothing is imported, no process starts).

Floors, lowest first: ``perparam/sharding/`` (pure: what each rank holds) < ``perparam/comm/`` (collectives)
< ``perparam/runtime/`` (groups, hooks) < the face (``perparam/*.py``: ``fully_shard``, ``ShardedModule``,
checkpoints). ``perparam/memory/`` (the planner) and ``perparam/offload/`` (the tiers' files and hooks)
stand beside them on ``sharding/`` alone; ``perparam/elastic/`` (in-memory snapshots) stands on the face;
``perparam/finetune/`` is a user of the face (and of ``memory/``). Every import counts: top-level, inside
functions and under ``TYPE_CHECKING``, so no circle can hide in a function-local import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

PACKAGE = Path(__file__).resolve().parents[1] / "perparam"

#: what each part may import (besides itself); the face may not import finetune, nothing may import upwards
ALLOWED = {
    "sharding": {"sharding"},
    "comm": {"sharding", "comm"},
    "runtime": {"sharding", "comm", "runtime"},
    "memory": {"sharding", "memory"},
    "offload": {"sharding", "offload"},
    "face": {"sharding", "comm", "runtime", "memory", "offload", "face"},
    "elastic": {"sharding", "comm", "runtime", "memory", "offload", "face", "elastic"},
    "finetune": {"face", "memory", "offload", "elastic", "finetune"},
}

#: tensor factories: called at a sharding module's import they would allocate
FACTORIES = {"tensor", "as_tensor", "empty", "zeros", "ones", "full", "rand", "randn", "randint", "arange",
             "linspace", "logspace", "eye", "empty_like", "zeros_like", "ones_like", "full_like",
             "from_numpy", "frombuffer", "Tensor"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def part_of(module: str) -> str:
    """``sharding``, ``comm``, ``runtime``, ``memory``, ``offload``, ``finetune`` or ``face`` (``perparam``
    itself and ``perparam/*.py``)."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ALLOWED and parts[1] != "face":
        return parts[1]
    return "face"


def _modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = _modules()


def _is_package(module: str) -> bool:
    return MODULES.get(module) is not None and MODULES[module].name == "__init__.py"


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if _is_package(module) else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, tree: ast.AST) -> list[tuple[str, int]]:
    """Every ``perparam`` module ``module`` imports, anywhere in its file, with the line: ``from X import
    name`` counts as importing ``X.name`` when that is a module, else ``X``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.append((sub if sub in MODULES else source, node.lineno))
    return [(name, line) for name, line in found if name == "perparam" or name.startswith("perparam.")]


def _graph() -> dict[str, list[tuple[str, int]]]:
    return {m: imports_of(m, ast.parse(p.read_text(), str(p))) for m, p in MODULES.items()}


def _cycles(graph: dict[str, list[tuple[str, int]]], known=None) -> list[list[str]]:
    """The strongly connected components with more than one module, or a module importing itself
    (Tarjan's algorithm); ``known``: the modules that count (default perparam's)."""
    known = MODULES if known is None else known
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _ in graph.get(v, ()):
            if w not in known:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or any(w == v for w, _ in graph.get(v, ())):
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_package_has_the_four_floors_and_the_parts_beside_them():
    parts = {part_of(m) for m in MODULES}
    assert parts == set(ALLOWED), parts


def test_no_module_of_perparam_is_in_an_import_circle():
    cycles = _cycles(_graph())
    assert not cycles, f"import circles (function-local and TYPE_CHECKING imports included): {cycles}"


def test_no_floor_imports_a_floor_above_it():
    wrong = []
    for module, imported in _graph().items():
        for target, line in imported:
            if part_of(target) not in ALLOWED[part_of(module)]:
                wrong.append(f"{MODULES[module].relative_to(PACKAGE.parent)}:{line}: {module} "
                             f"({part_of(module)}) imports {target} ({part_of(target)})")
    assert not wrong, ("imports against the layers sharding < comm < runtime < face (memory, offload: "
                       "sharding only; finetune: the face, memory and offload):\n" + "\n".join(wrong))


def test_memory_never_imports_the_runtime():
    for module, imported in _graph().items():
        if part_of(module) == "memory":
            assert not [t for t, _ in imported if part_of(t) in ("runtime", "comm")], module


def _sharding_files():
    return [(m, p) for m, p in MODULES.items() if part_of(m) == "sharding"]


@pytest.mark.parametrize("module,path", _sharding_files(), ids=[m for m, _ in _sharding_files()])
def test_sharding_imports_no_process_group_api(module, path):
    """``torch.distributed.tensor`` (placements, DTensor types) is allowed; ``torch.distributed`` itself,
    ``distributed_c10d``, ``device_mesh`` and the rest are not."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [f"{node.module}.{a.name}" if node.module == "torch.distributed" else node.module
                     for a in node.names]
        for name in names:
            if name.startswith("torch.distributed") and not name.startswith("torch.distributed.tensor"):
                bad.append(f"line {node.lineno}: {name}")
    assert not bad, f"{module} (pure floor) imports process-group APIs: {bad}"


def _import_time_nodes(tree: ast.Module):
    """The nodes that run when the module is imported: everything outside function bodies."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for d in getattr(node, "decorator_list", []):  # decorators and defaults run at import
                todo.append(d)
            todo += [d for d in node.args.defaults + node.args.kw_defaults if d is not None]
            continue
        yield node
        todo += list(ast.iter_child_nodes(node))


@pytest.mark.parametrize("module,path", _sharding_files(), ids=[m for m, _ in _sharding_files()])
def test_sharding_allocates_no_tensor_at_import(module, path):
    calls = []
    for node in _import_time_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            owner = (func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
                     else "")
            if name in FACTORIES and owner in ("torch", ""):
                calls.append(f"line {node.lineno}: {ast.unparse(node)[:60]}")
    assert not calls, f"{module} (pure floor) allocates tensors at import: {calls}"


def test_the_checks_see_an_upward_import_hidden_in_a_function():
    """The reader itself: a function-local import from the pure floor up to the runtime is an import."""
    tree = ast.parse("def f():\n    from ..runtime import group\n")
    assert imports_of("perparam.sharding.layout", tree) == [("perparam.runtime.group", 2)]
    assert "runtime" not in ALLOWED[part_of("perparam.sharding.layout")]


# -- CONTRIBUTING's rules, read from the source ---------------------------------------------------------
#: the core: every file of perparam/ but the main job's (perparam/finetune/, a user of perparam)
CORE = {m: p for m, p in MODULES.items() if part_of(m) != "finetune"}

#: torch.distributed calls that move bytes between ranks
DIST_COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
                    "all_gather_single", "all_to_all", "all_to_all_single", "barrier", "batch_isend_irecv",
                    "broadcast", "broadcast_object_list", "gather", "gather_object", "irecv", "isend",
                    "monitored_barrier", "recv", "reduce", "reduce_scatter", "reduce_scatter_single",
                    "reduce_scatter_tensor", "scatter", "scatter_object_list", "send"}
#: perparam.comm's issuing functions
COMM_ISSUERS = {"all_gather_rows", "all_gather_in_place", "all_gather_objects", "all_reduce_sum",
                "exchange_rows", "exchange_uneven", "reduce_scatter_in_place", "reduce_scatter_sum",
                "reduce_to_owners", "tree_all_reduce_sum"}
#: where a collective may be issued (CONTRIBUTING, "Where collectives are issued"): comm/ issues them
#: through torch.distributed; the paths (runtime/paths/: one file each, its mechanism inside) and the common
#: tail of a reduction (the HSDP all-reduce), issue them through comm/; the face's exceptions talk to
#: torch.distributed themselves, each for a reason of its own
ISSUE_DIST = {"perparam.comm": "the collectives",
              "perparam.checkpoint": "ranks agree on what a save writes (all_gather_object), barriers",
              "perparam.full_state": "a full state dict gathered or broadcast one tensor at a time",
              "perparam.elastic": "snapshots: replicas sent point-to-point, the ranks agree on the newest "
                                  "complete one"}
ISSUE_COMM = {"perparam.runtime.paths": "the paths",
              "perparam.runtime.part": "a reduction's common tail: the HSDP all-reduce",
              "perparam.clip": "clip_grad_norm_: the squared norms of every mesh all-reduced",
              "perparam.invariant": "K-invariant training: per-unit losses and per-row squared norms "
                                    "all-reduced",
              "perparam.runtime.owner_exchange": "whole-matrix optimizers: the owner gather and scatter at "
                                                 "the step",
              "perparam.runtime.owner_state": "whole-matrix optimizers: their state moved for a checkpoint",
              "perparam.runtime.recast": "a cast of owner parameters: the ranks agree whether it is refused"}
#: module-level names a core function rebinds (``global``): state, none of them a switch of how perparam
#: runs; the switches are ``RuntimeConfig`` fields (``perparam.configure``), and ``set_debug`` the one
#: exception (comm/ is below the runtime's config; the checks change no result)
REBOUND = {("perparam.runtime.config", "_current"): "the RuntimeConfig itself",
           ("perparam.comm.debug", "_enabled"): "set_debug",
           ("perparam.comm.debug", "_timeout_s"): "set_debug",
           ("perparam.api", "_WARNED_LOW_PRECISION"): "warned once",
           ("perparam.checkpoint.background", "_GROUP"): "the writer's process group",
           ("perparam.checkpoint.background", "_EXECUTOR"): "the writer thread",
           ("perparam.offload.tier", "_order"): "the last forward's order",
           ("perparam.offload.tier", "_current"): "this one's",
           ("perparam.offload.mapped", "_EXECUTORS"): "the I/O threads",
           ("perparam.offload.mapped", "_libc"): "libc"}


def _within(module: str, homes) -> bool:
    return any(module == h or module.startswith(h + ".") for h in homes)


def collectives_issued(tree: ast.AST) -> list[tuple[str, int]]:
    """``dist.X(...)`` / ``torch.distributed.X(...)`` for a collective X, and ``collectives.Y(...)`` (or
    ``Y(...)`` imported from it) for one of comm's issuing functions, with their lines."""
    imported = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and (node.module or "").split(".")[-1] == "collectives"
                for a in node.names if a.name in COMM_ISSUERS}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in imported:
            found.append((f"collectives.{node.func.id}", node.lineno))
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner, name = ast.unparse(node.func.value), node.func.attr
        if owner in ("dist", "torch.distributed") and name in DIST_COLLECTIVES:
            found.append((f"dist.{name}", node.lineno))
        elif owner == "collectives" and name in COMM_ISSUERS:
            found.append((f"collectives.{name}", node.lineno))
    return found


def test_collectives_are_issued_only_in_comm_the_paths_and_the_stated_exceptions():
    wrong = []
    for module, path in CORE.items():
        for call, line in collectives_issued(ast.parse(path.read_text())):
            homes = ISSUE_DIST if call.startswith("dist.") else ISSUE_COMM
            if not _within(module, homes):
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {call}")
    assert not wrong, ("collectives issued outside comm/ and the paths (CONTRIBUTING lists the exceptions):\n"
                       + "\n".join(wrong))


def test_the_collective_reader_sees_both_spellings():
    tree = ast.parse("from ..comm.collectives import exchange_uneven\ndef f(x, g):\n    dist.all_reduce(x)\n"
                     "    collectives.all_reduce_sum(x, g)\n    exchange_uneven(x)\n    x.sum()\n")
    assert sorted(collectives_issued(tree), key=lambda c: c[1]) == [
        ("dist.all_reduce", 3), ("collectives.all_reduce_sum", 4), ("collectives.exchange_uneven", 5)]


def _rebinds(tree: ast.AST) -> set[str]:
    return {name for node in ast.walk(tree) if isinstance(node, ast.Global) for name in node.names}


def _module_constants_set_from_outside(tree: ast.AST) -> list[tuple[str, int]]:
    """``alias.NAME = ...`` with an upper-case ``NAME``: a module's constant changed from outside it."""
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                and t.attr.lstrip("_").isupper()):
                found.append((ast.unparse(t), node.lineno))
    return found


def test_no_module_level_runtime_switch_outside_runtime_config():
    rebound = sorted((m, n) for m, p in CORE.items() for n in _rebinds(ast.parse(p.read_text())))
    assert ([r for r in rebound if r not in REBOUND]
            == []), "module-level names rebound: make a switch a RuntimeConfig field"
    benchmarks = PACKAGE.parent / "benchmarks"
    set_outside = [f"{p.relative_to(PACKAGE.parent)}:{line}: {what}"
                   for p in [*CORE.values(), *sorted(benchmarks.rglob("*.py"))]
                   for what, line in _module_constants_set_from_outside(ast.parse(p.read_text()))]
    assert not set_outside, ("module constants set from outside (use perparam.configure):\n"
                             + "\n".join(set_outside))


def test_the_switch_reader_sees_a_constant_set_from_outside():
    assert _module_constants_set_from_outside(ast.parse("tier.GATHER_READ_AHEAD = 0\nx.y = 1\n")) == [
        ("tier.GATHER_READ_AHEAD", 1)]


#: attribute names of the features that decide how bytes move or what a reduction does: custom collectives,
#: hpZ, offload, qgZ, the gloo algorithms, HSDP's partial hold, the all-reduce hook, the divide factor, the
#: ZeRO stages, placements and quantization, the device, K-invariance, precision islands
FEATURE_FLAGS = {"all_gather_comm", "reduce_scatter_comm", "hpz", "hpz_given", "secondary", "offload",
                 "offload_hook", "grad_quant", "gloo_all_gather", "gloo_reduce_scatter", "zero_copy",
                 "requires_all_reduce", "all_reduce_hook", "gradient_divide_factor", "kept", "whole_grad",
                 "zero_stage", "keeps_unsharded", "replicated", "plain", "quantized", "stored_quant",
                 "wire_is_layout", "device", "is_cuda", "invariant", "islands", "tp"}
MAX_CALL_SETTINGS = 8


def test_the_call_declares_its_feature_settings_and_reads_none():
    # runtime/group.py (the fully_shard call) holds its settings; its mesh parts (part.py)
    # and the paths read them, so no feature is decided in the call
    tree = ast.parse((PACKAGE / "runtime" / "group.py").read_text())
    read = sorted({n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in FEATURE_FLAGS
                   and isinstance(n.ctx, ast.Load)})
    named = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in FEATURE_FLAGS}
    named |= {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name in FEATURE_FLAGS}
    assert read == [], f"runtime/group.py reads feature flags (read them in the part or the path): {read}"
    assert len(named) <= MAX_CALL_SETTINGS, (f"runtime/group.py names {len(named)} feature settings: "
                                             f"{sorted(named)}")


def test_no_test_file_imports_another():
    """Helpers shared by test files live beside the harness (``tests/*_helpers.py``, ``tests/*_cases.py``,
    ``tests/models.py``), never in a test module (CONTRIBUTING.md, "the test harness")."""
    tests = Path(__file__).parent
    bad = []
    for path in sorted(tests.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            bad += [f"{path.name}: {n}" for n in names if n.startswith("tests.test_")]
    assert not bad, bad


def test_the_checkpoint_family_is_one_folder():
    """(No private name crosses its files, nor any other files: ``tests/test_code_rules.py``.)"""
    folder = PACKAGE / "checkpoint"
    assert (folder / "__init__.py").is_file() and not sorted(PACKAGE.glob("checkpoint*.py"))
    homes = [m for m, p in CORE.items() for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, ast.ClassDef) and node.name in ("CheckpointError", "CheckpointDamagedError")]
    assert homes == ["perparam.errors", "perparam.errors"], homes  # one home for the family's errors


# benchmarks/: the scripts at the top, what they share in harness/, the GPU check in gpu/ (CONTRIBUTING.md)
BENCHMARKS = PACKAGE.parent / "benchmarks"
#: what each part of benchmarks/ may import of benchmarks/ (besides perparam, torch, ...)
BENCHMARK_ALLOWED = {"harness": {"harness"}, "gpu": {"harness", "gpu"}, "scripts": {"harness"}}


def benchmark_part(module: str) -> str:
    """``harness``, ``gpu`` or ``scripts`` (``benchmarks`` itself and ``benchmarks/*.py``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ("harness", "gpu")) else "scripts"


def _benchmark_modules() -> dict[str, Path]:
    out = {}
    for p in sorted(BENCHMARKS.rglob("*.py")):
        parts = list(p.relative_to(BENCHMARKS.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


BENCHMARK_MODULES = _benchmark_modules()


def benchmark_imports(module: str, tree: ast.AST, known=None) -> list[tuple[str, str | None, int]]:
    """``(module, name or None, line)`` for each import of a ``benchmarks`` module anywhere in the file:
    ``from X import name`` gives ``(X.name, None)`` when that is a module, else ``(X, name)``."""
    known = BENCHMARK_MODULES if known is None else known
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level]
                source = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.append((sub, None, node.lineno) if sub in known else (source, alias.name, node.lineno))
    return [f for f in found if f[0] == "benchmarks" or f[0].startswith("benchmarks.")]


def _benchmark_graph() -> dict[str, list[tuple[str, str | None, int]]]:
    return {m: benchmark_imports(m, ast.parse(p.read_text(), str(p))) for m, p in BENCHMARK_MODULES.items()}


def test_the_benchmarks_have_the_harness_and_the_gpu_check_as_packages():
    assert {"benchmarks", "benchmarks.harness", "benchmarks.gpu"} <= BENCHMARK_MODULES.keys()


def test_no_benchmark_module_is_in_an_import_circle():
    graph = {m: [(w, line) for w, _, line in found] for m, found in _benchmark_graph().items()}
    assert _cycles(graph, BENCHMARK_MODULES) == []


def test_a_benchmark_imports_the_harness_only_and_the_harness_imports_no_benchmark():
    wrong = [f"{BENCHMARK_MODULES[m].relative_to(PACKAGE.parent)}:{line}: imports {w}"
             for m, found in _benchmark_graph().items() for w, _, line in found
             if w != "benchmarks" and benchmark_part(w) not in BENCHMARK_ALLOWED[benchmark_part(m)]]
    assert not wrong, ("benchmarks/: a script imports benchmarks/harness/ only, benchmarks/gpu/ the harness "
                       "and itself, the harness itself (move what two scripts share into the harness):\n"
                       + "\n".join(wrong))


def test_no_benchmark_imports_the_tests():
    """What tests and benchmarks share (the fault harness, the model) lives in ``benchmarks/harness/``, which
    the tests import; ``benchmarks/`` never imports ``tests/`` (CONTRIBUTING.md)."""
    wrong = []
    for path in BENCHMARK_MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            wrong += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {n}" for n in names
                      if n == "tests" or n.startswith("tests.")]
    assert not wrong, ("benchmarks/ imports tests/ (move what both need into benchmarks/harness/):\n"
                       + "\n".join(wrong))


def test_the_benchmark_checks_see_a_circle_a_private_name_and_an_upward_import():
    known = {"benchmarks.harness.a": None, "benchmarks.gpu.b": None, "benchmarks.c": None}
    a = benchmark_imports("benchmarks.harness.a",
                          ast.parse("def f():\n    from benchmarks.gpu.b import _g\n"), known)
    b = benchmark_imports("benchmarks.gpu.b", ast.parse("from ..harness import a\nimport torch\n"), known)
    assert a == [("benchmarks.gpu.b", "_g", 2)] and b == [("benchmarks.harness.a", None, 1)]
    assert _cycles({"benchmarks.harness.a": [(a[0][0], 2)], "benchmarks.gpu.b": [(b[0][0], 1)]}, known) == [
        ["benchmarks.gpu.b", "benchmarks.harness.a"]]
    assert benchmark_part("benchmarks.gpu.b") not in BENCHMARK_ALLOWED[benchmark_part("benchmarks.harness.a")]
    assert benchmark_part("benchmarks.c") == "scripts" and benchmark_part("benchmarks.harness") == "harness"
