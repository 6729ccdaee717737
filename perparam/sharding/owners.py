"""Pure: which rank of a shard axis steps each whole-matrix parameter (``ParamPolicy(update="owner")``).

A whole-matrix optimizer (``torch.optim.Muon``'s Newton-Schulz iteration, ``torch.optim.Adafactor``'s
factored second moments) needs the whole matrix, so under the owner policy one rank of the parameter's
shard axis (its *owner*) steps it whole and the others skip it (``perparam.runtime.owner_step``). The cost
of a step is dominated by Newton-Schulz: ``ns_steps`` iterations of three matrix products on the
``min(m, n)``-side Gram matrix, about ``ns_steps * m * n * min(m, n)`` multiply-adds for an ``m x n``
matrix (a parameter of more dims counts as ``shape[0] x prod(shape[1:])``).

``owner_plan`` is Graham's LPT rule (longest processing time first): parameters in decreasing cost, each
onto the least-loaded rank (ties to the lowest rank). Equal costs are taken kind by kind (``kinds``: the
shapes, in the order each first appears), then by their order in the list, so the matrices of one shape
are dealt round the ranks together: a cost that the model does not see and that depends on the shape (on
CPU a tall matrix is transposed before its products, slower per multiply-add than its wide twin of the
same cost) is then spread alike too: the 27.4M GPT's 2048 x 512 and 512 x 2048 matrices, dealt in list
order, went all tall to rank 0 and all wide to rank 1 (the balance before and after: ``muon_balance`` in
``benchmarks/README.md``). Its busiest rank
carries at most ``(4/3 - 1/(3K))`` times the optimal busiest load (Graham, 1969, "Bounds on
multiprocessing timing anomalies") and at most the mean load plus the largest cost. The plan depends only
on the shapes, their order and K, so every rank computes the same one without communicating; the runtime
and ``perparam plan`` both call it.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

#: Newton-Schulz iterations of ``torch.optim.Muon`` by default (its ``ns_steps``)
NS_STEPS = 5


def ns_cost(shape: Sequence[int], ns_steps: int = NS_STEPS) -> int:
    """Newton-Schulz multiply-adds of one step of an ``m x n`` matrix: ``ns_steps * m * n * min(m, n)``
    (``m = shape[0]``, ``n = prod(shape[1:])``; 0 for an empty or 0/1-dim shape's degenerate cases)."""
    if not shape:
        return 0
    m, n = shape[0], math.prod(shape[1:])
    return ns_steps * m * n * min(m, n)


@dataclass(frozen=True)
class OwnerPlan:
    """``owners[i]``: the rank (``0 <= r < num_ranks``) stepping parameter ``i``; ``loads[r]``: rank ``r``'s
    summed cost (``ns_cost`` units: multiply-adds)."""

    owners: tuple[int, ...]
    loads: tuple[int, ...]

    @property
    def balance(self) -> float:
        """The busiest rank's load over the mean load (1.0: perfect; 1.0 when nothing costs anything)."""
        total = sum(self.loads)
        return max(self.loads) * len(self.loads) / total if total else 1.0


def owner_plan(costs: Sequence[int], num_ranks: int, fixed: Mapping[int, int] | None = None,
               kinds: Sequence[Hashable] | None = None) -> OwnerPlan:
    """The LPT plan of ``costs`` (one non-negative cost per parameter, e.g. ``ns_cost(shape)``) over
    ``num_ranks`` ranks. ``fixed``: index -> rank for parameters whose owner is kept (they hold state
    there: the runtime's earlier plan when an optimizer gains parameters); the others are placed by LPT
    onto the loads these leave. ``kinds``: one hashable per parameter (its shape), the tie-break among
    equal costs (module docstring); ``None``: every parameter its own kind. Raises ``ValueError`` for
    ``num_ranks < 1``, a negative cost, a fixed rank out of range or ``kinds`` of another length."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if any(c < 0 for c in costs):
        raise ValueError(f"costs must be >= 0, got {list(costs)}")
    if kinds is not None and len(kinds) != len(costs):
        raise ValueError(f"kinds must have one entry per cost ({len(costs)}), got {len(kinds)}")
    first: dict = {}
    kind_rank = [first.setdefault(kind, i)
                 for i, kind in enumerate(kinds)] if kinds is not None else range(len(costs))
    fixed = dict(fixed or {})
    if any(not 0 <= r < num_ranks for r in fixed.values()):
        raise ValueError(f"fixed owners must be ranks in [0, {num_ranks}), got {fixed}")
    loads = [0] * num_ranks
    owners = [0] * len(costs)
    for i, r in fixed.items():
        owners[i] = r
        loads[r] += costs[i]
    for i in sorted((i for i in range(len(costs)) if i not in fixed),
                    key=lambda i: (-costs[i], kind_rank[i], i)):
        r = min(range(num_ranks), key=lambda r: (loads[r], r))
        owners[i] = r
        loads[r] += costs[i]
    return OwnerPlan(tuple(owners), tuple(loads))


def plan_shapes(shapes: Sequence[Sequence[int]], num_ranks: int, ns_steps: int = NS_STEPS) -> OwnerPlan:
    """``owner_plan`` of the Newton-Schulz costs of ``shapes`` (the parameters' global shapes, in a fixed
    order: the runtime's is the optimizer's parameter order, the same on every rank)."""
    return owner_plan([ns_cost(s, ns_steps) for s in shapes], num_ranks, kinds=[tuple(s) for s in shapes])
