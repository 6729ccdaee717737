"""``make test-fast`` (``pytest -m fast``) runs the tests marked ``fast`` where they are written: a file's
``pytestmark``, a test's ``@pytest.mark.fast``, or one parametrization's ``pytest.param(..., marks=...)``.
These checks read the test files' source (AST only: nothing imported, no process) so that a removed mark or
a renamed file cannot silently drop a feature from the loop."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

TESTS = Path(__file__).resolve().parent

#: the features whose one parity (or collective-count) test on gloo ranks the fast loop keeps; each file
#: must keep at least one fast test (a new feature adds its file here with its marked test)
FEATURES = (
    "test_fully_shard_parity.py", "test_writes_seen.py", "test_init_matches_unsharded.py",
    "test_elastic_slots.py", "test_collective_counts.py", "test_policies.py", "test_hsdp.py",
    "test_tensor_parallel.py", "test_runtime_routes.py", "test_rank_dependent_use.py",
    "test_precision_islands.py", "test_nf4.py", "test_zero_dim_params.py", "test_full_state_dict.py",
    "test_meta_assign_load.py", "test_stored_dtype.py", "test_fsdp2_api_parity.py",
    "test_iteration_context.py", "test_no_import_side_effects.py", "test_custom_collectives.py",
    "test_clip_grad_norm.py", "test_expert_parallel.py", "test_post_accumulate_grad_hooks.py",
    "test_zero_stages.py", "test_invariant_training.py", "test_hpz.py", "test_zero_copy_gather.py",
    "test_zero_copy_reduce_scatter.py", "test_whole_matrix.py", "test_grad_quant.py", "test_param_mesh.py",
    "test_offload_plan.py", "test_offload.py", "test_paths.py", "test_resolution_once.py",
    "test_threaded_ranks.py", "test_local_optimizer_step.py", "test_owner_zero_grad.py",
    "test_block_output_objects.py", "test_invariant_uncounted_grads.py",
)


def _is_fast(node: ast.AST) -> bool:
    """``node`` is ``pytest.mark.fast``, or a list/tuple holding it."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return any(_is_fast(e) for e in node.elts)
    return isinstance(node, ast.Attribute) and node.attr == "fast" and ast.unparse(node) == "pytest.mark.fast"


def _marks_fast_param(node: ast.AST) -> bool:
    """``node`` contains a ``pytest.param(..., marks=pytest.mark.fast)``."""
    return any(isinstance(call, ast.Call) and ast.unparse(call.func) == "pytest.param"
               and any(k.arg == "marks" and _is_fast(k.value) for k in call.keywords)
               for call in ast.walk(node))


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def fast_tests(path: Path) -> tuple[bool, set[str]]:
    """``(whole_file, names)``: whether the file's ``pytestmark`` holds ``fast``, and the test functions
    marked fast (all of them for a whole file; those decorated, or with a fast parametrization)."""
    tree = _tree(path)
    whole = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                and _is_fast(n.value) for n in tree.body)
    names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")
             and (whole or any(_is_fast(d) or _marks_fast_param(d) for d in n.decorator_list))}
    return whole, names


def _files() -> list[Path]:
    return sorted(TESTS.glob("test_*.py"))


def _placed_fast_marks(tree: ast.Module) -> int:
    """How many ``pytest.mark.fast`` the reader above counts: in ``pytestmark``, a test's decorators, or a
    decorator's ``pytest.param(marks=...)``."""
    placed = [n.value for n in tree.body if isinstance(n, ast.Assign)
              and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)]
    placed += [d for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")
               for d in n.decorator_list]
    return sum(1 for root in placed
               for node in ast.walk(root) if _is_fast(node) and isinstance(node, ast.Attribute))


def _slow_tests(tree: ast.Module) -> set[str]:
    slow_file = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                    and "pytest.mark.slow" in ast.unparse(n.value) for n in tree.body)
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef)
            and (slow_file or any(ast.unparse(d) == "pytest.mark.slow" for d in n.decorator_list))}


def test_every_fast_mark_is_placed_where_this_reader_sees_it_and_none_on_a_slow_test():
    # a mark spelt or placed otherwise (an alias, a helper's decorator) would escape the composition check;
    # a slow test (over 60 s) does not belong in the development loop
    unseen, both = [], []
    for path in _files():
        if "mark.fast" not in path.read_text():  # no mark to find (the parse is the cost)
            continue
        tree = _tree(path)
        written = sum(1 for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "fast"
                      and _is_fast(node))
        if written != _placed_fast_marks(tree):
            unseen.append(path.name)
        both += [f"{path.name}::{name}" for name in _slow_tests(tree) & fast_tests(path)[1]]
    assert not unseen, f"fast marks outside pytestmark, a test's decorators or pytest.param: {unseen}"
    assert not both, f"marked fast and slow: {both}"


def test_the_fast_loop_keeps_one_parity_test_per_feature_and_the_pure_files_whole():
    missing = [f for f in FEATURES if not (TESTS / f).exists() or not fast_tests(TESTS / f)[1]]
    assert not missing, f"feature files without a fast test (renamed, or their mark removed?): {missing}"
    pure = [p for p in _files() if p.name.endswith("_properties.py")]
    pure += [TESTS / n for n in ("test_layers.py", "test_public_names.py", "test_fast_selection.py")]
    partial = [p.name for p in pure if not fast_tests(p)[0]]
    assert not partial, ("pure test files not marked fast as a whole (pytestmark = pytest.mark.fast): "
                         f"{partial}")


#: a suite's size or duration written out: "933 tests", "21 min", "3 minutes"
STATED = re.compile(r"\b\d+ tests\b|\b\d+ min(?:utes)?\b")


def test_the_suites_size_and_time_are_stated_in_the_readme_alone():
    # README.md (Two commands) states the whole suite's and the fast loop's size and time once; CONTRIBUTING
    # and the Makefile point to it, so the three cannot disagree
    readme = (TESTS.parent / "README.md").read_text()
    assert len(re.findall(r"`make test` runs \d+\s+tests", readme)) == 1, "README: `make test` runs N tests"
    assert len(re.findall(r"`make test-fast` \(\d+ tests", readme)) == 1, "README: `make test-fast` (N tests"
    for name in ("CONTRIBUTING.md", "Makefile"):
        text = (TESTS.parent / name).read_text()
        stated = [m.group() for m in STATED.finditer(text)]
        assert not stated, (f"{name} states the suite's size or time ({stated}): state it in README.md, "
                            "point there")
        assert "README.md" in text, f"{name} does not point to README.md for the suite's size and time"
