"""The ways bytes move (``perparam/runtime/paths/``): each chooser's precedence as a table (first rule that
holds wins), and a new path added as one class plus one row of the chooser: a counting reduce-scatter
path, inserted first, carries every reduction of a 2-rank run, bitwise as the packed path it wraps."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

import perparam
from perparam import CommCounter
from perparam.runtime.paths import choose
from perparam.runtime.paths.gather import GatherFacts
from perparam.runtime.paths.reduce import ReduceFacts
from perparam.runtime.paths.reduce_packed import PackedReduceScatter
from tests.distributed import run_distributed

G = GatherFacts(secondary=False, custom=False, algorithm="zero_copy", hpz=False, zero_copy=True, quantized=False)

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

R = ReduceFacts(whole=False, wire=None, custom=False, algorithm="zero_copy", hpz=False, zero_copy=True, cpu=True)

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
    assert choose.gather_path(G._replace(**changes)).name == name


@pytest.mark.fast
@pytest.mark.parametrize("changes, name", REDUCE_TABLE)
def test_the_reduction_chooser_takes_the_first_rule_that_holds(changes, name):
    assert choose.reduce_path(R._replace(**changes)).name == name


class CountingReduceScatter(PackedReduceScatter):
    """A new path: the packed reduce-scatter, counting the reductions it issues."""

    name = "counting"

    def __init__(self) -> None:
        self.issued = 0

    def issue(self, part, params, grads, used, dtype, plan):
        self.issued += 1
        return super().issue(part, params, grads, used, dtype, plan)


def _train(rank: int, world_size: int, counting: bool) -> dict:
    path = CountingReduceScatter()
    row = (lambda f: not f.whole and f.wire is None, path)
    if counting:
        choose.REDUCE_RULES.insert(0, row)  # the one line a new path adds to the chooser
    previous = perparam.configure(gloo_reduce_scatter="all_to_all")
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
        perparam.fully_shard(model[0])
        perparam.fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        with CommCounter() as comm:
            for _ in range(2):
                x = torch.randn(2 * world_size, 3, generator=g)[2 * rank:2 * rank + 2]
                opt.zero_grad()
                model(x).pow(2).sum().backward()
                opt.step()
        return {"issued": path.issued, "reduce_scatters": comm.count("reduce_scatter"),
                "params": [p.full_tensor() for p in model.parameters()]}
    finally:
        perparam.configure(gloo_reduce_scatter=previous.gloo_reduce_scatter)
        if counting:
            choose.REDUCE_RULES.remove(row)


def _both(rank: int, world_size: int) -> tuple[dict, dict]:
    return _train(rank, world_size, False), _train(rank, world_size, True)


def test_a_new_reduction_path_is_one_class_and_one_row_of_the_chooser():
    for packed, counted in run_distributed(_both, 2):
        assert packed["issued"] == 0 and counted["issued"] == 4  # 2 groups x 2 steps, all through the new path
        assert counted["reduce_scatters"] == packed["reduce_scatters"] == 4
        assert all(torch.equal(a, b) for a, b in zip(packed["params"], counted["params"]))


def test_the_common_tail_of_a_reduction_names_no_path():
    """What follows every path (the HSDP all-reduce, the partial hold, the division and the accumulation:
    ``part_reduce.py``, ``partial.py``, ``reduction.py``) asks the reduction's tail (``reduction.ReduceTail``,
    which a path may replace) and the chooser, never which path ran: no name of the owner path's, and no
    import of a path's own module, in those files."""
    runtime = Path(perparam.__file__).parent / "runtime"
    for name in ("part_reduce.py", "partial.py", "reduction.py"):
        tree = ast.parse((runtime / name).read_text())
        names = ({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
                 | {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
                 | {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)})
        assert not sorted(x for x in names if "owner" in x.lower()), (name, sorted(x for x in names if "owner" in x))
        imported = [f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                    for a in n.names]
        assert not [m for m in imported if m.startswith("paths.") and m.split(".")[1].startswith("reduce_")], imported
