"""The ways bytes move (``perparam/runtime/paths/``): each chooser's precedence as a table (first rule that
holds wins), the extension point that adds a row, and the common tail of a reduction naming no path (a new
path added as its file, one row and its test: ``test_a_new_reduce_path.py``)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import perparam
from perparam.runtime.paths import choose
from perparam.runtime.paths.gather import GatherFacts
from perparam.runtime.paths.reduce import ReduceFacts
from perparam.runtime.paths.reduce_packed import PackedReduceScatter

G = GatherFacts(secondary=False, custom=False, algorithm="zero_copy", hpz=False, zero_copy=True,
                quantized=False)

#: (facts changed from ``G``, the path taken)
GATHER_TABLE = [
    ({}, "zero-copy"),
    ({"algorithm": "all_to_all"}, "packed rows"),
    ({"algorithm": "native"}, "packed rows"),
    ({"zero_copy": False}, "packed rows"),  # Shard(d > 0), TP, another backend, K = 1
    ({"hpz": True}, "packed rows"),  # hpZ keeps the forward's rows
    ({"zero_copy": False, "quantized": True}, "quantized pieces"),
    ({"zero_copy": False, "quantized": True, "custom": True}, "custom all-gather"),
    ({"custom": True}, "custom all-gather"),  # before zero-copy
    ({"secondary": True, "hpz": True}, "hpZ secondary"),
    ({"secondary": True, "hpz": True, "custom": True, "quantized": True}, "hpZ secondary"),  # before custom
]

R = ReduceFacts(whole=False, wire=None, custom=False, algorithm="zero_copy", hpz=False, zero_copy=True,
                cpu=True)

REDUCE_TABLE = [
    ({}, "zero-copy reduce-scatter"),
    ({"algorithm": "all_to_all"}, "packed reduce-scatter"),
    ({"cpu": False}, "packed reduce-scatter"),  # gradients on an accelerator
    ({"zero_copy": False}, "packed reduce-scatter"),
    ({"hpz": True}, "packed reduce-scatter"),
    ({"custom": True}, "custom reduce-scatter"),
    ({"wire": "int8"}, "qgZ all-to-all"),
    ({"wire": "int8", "custom": True}, "qgZ all-to-all"),  # which refuses the custom collective
    ({"whole": True}, "whole-gradient all-reduce"),
    ({"whole": True, "custom": True, "wire": "int8"}, "whole-gradient all-reduce"),
    ({"invariant": True}, "invariant tree reduce-scatter"),  # perparam.InvariantUnits
    ({"invariant": True, "whole": True}, "invariant tree all-reduce"),
    ({"to_owner": True}, "reduce to owner"),  # configure(owner_grad="owner"), before zero-copy
    ({"to_owner": True, "custom": True}, "custom reduce-scatter"),  # the user's collective carries it
    ({"invariant": True, "pair": True}, "zero-copy reduce-scatter"),  # K = 2: peer + own is the tree's sum
    ({"invariant": True, "pair": True, "algorithm": "all_to_all"}, "invariant tree reduce-scatter"),
    ({"invariant": True, "pair": True, "zero_copy": False}, "invariant tree reduce-scatter"),
    ({"invariant": True, "pair": True, "whole": True}, "invariant tree all-reduce"),
]


@pytest.mark.fast
@pytest.mark.parametrize("changes, name", GATHER_TABLE)
def test_the_all_gather_chooser_takes_the_first_rule_that_holds(changes, name):
    assert choose.gather_path(dataclasses.replace(G, **changes)).name == name


@pytest.mark.fast
@pytest.mark.parametrize("changes, name", REDUCE_TABLE)
def test_the_reduction_chooser_takes_the_first_rule_that_holds(changes, name):
    assert choose.reduce_path(dataclasses.replace(R, **changes)).name == name


@pytest.mark.fast
def test_a_row_added_from_outside_goes_before_the_named_path_and_leaves_with_its_block():
    class Recording(PackedReduceScatter):
        name = "recording"

    before = list(choose.REDUCE_RULES)
    version = choose.REDUCE_RULES.version
    with choose.REDUCE_RULES.add(lambda f: True, Recording(), before="custom reduce-scatter"):
        assert choose.reduce_path(R).name == "recording"  # before the custom and zero-copy rows
        assert choose.reduce_path(dataclasses.replace(R, wire="int8")).name == "qgZ all-to-all"  # rows above
        assert choose.reduce_path(dataclasses.replace(R, whole=True)).name == "whole-gradient all-reduce"
        cache: dict = {}
        assert choose.reduce_path(dataclasses.replace(R, cpu=False), cache).name == "recording"
    assert list(choose.REDUCE_RULES) == before and choose.REDUCE_RULES.version == version + 2
    assert choose.reduce_path(dataclasses.replace(R, cpu=False), cache).name == "packed reduce-scatter"
    with pytest.raises(ValueError, match="no path named 'nothing'"):
        choose.REDUCE_RULES.add(lambda f: True, Recording(), before="nothing")
    with pytest.raises(TypeError):
        ReduceFacts(False, None, False, "zero_copy", False, True)  # facts are built by keyword


def test_the_common_tail_of_a_reduction_names_no_path():
    """What follows every path (the HSDP all-reduce, the partial hold, the division and the accumulation:
    ``part.py``, ``partial.py``, ``reduction.py``) asks the reduction's tail (``reduction.ReduceTail``,
    which a path may replace) and the chooser, never which path ran: no name of the owner path's or the
    zero-copy one's, and no import of a path's own module (or of a module holding a path's mechanism)."""
    runtime = Path(perparam.__file__).parent / "runtime"
    for name in ("part.py", "partial.py", "reduction.py"):
        tree = ast.parse((runtime / name).read_text())
        names = ({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
                 | {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
                 | {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)})
        owners = sorted(x for x in names if "owner" in x.lower())
        assert not owners, (name, owners)
        imported = [f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                    for a in n.names]
        assert not [m for m in imported
                    if m.startswith("paths.") and m.split(".")[1].startswith("reduce_")], imported
        assert not sorted(x for x in names if "zero_copy" in x.lower()), name
        mechanisms = ("zero_copy", "grad_quant", "hpz", "qgz")
        assert not [m for m in imported if any(w in m for w in mechanisms)], imported
