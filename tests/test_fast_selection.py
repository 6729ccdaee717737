"""``make test-fast`` selects tests by name (``FAST`` in ``tests/conftest.py``): every entry must still name a
test file, and a test in it, so a rename cannot silently shrink the fast loop."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import FAST

TESTS = Path(__file__).resolve().parent


def _test_names(path: Path) -> set[str]:
    return {node.name for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_every_fast_entry_names_an_existing_test():
    missing = []
    for entry in FAST:
        file, _, prefix = entry.partition("::")
        prefix = prefix.split("[")[0]
        path = TESTS / file
        if not path.exists():
            missing.append(entry)
        elif prefix and not any(name.startswith(prefix) for name in _test_names(path)):
            missing.append(entry)
    assert not missing, f"FAST entries that name no test (renamed or removed?): {missing}"


def test_the_fast_loop_has_one_parity_test_per_core_feature():
    files = {entry.partition("::")[0] for entry in FAST}
    for feature in ("test_fully_shard_parity.py", "test_policies.py", "test_hsdp.py", "test_tensor_parallel.py",
                    "test_runtime_routes.py", "test_rank_dependent_use.py", "test_nf4.py", "test_full_state_dict.py"):
        assert feature in files, feature
