"""The only place a path is picked: one chooser per seam, each a table of ``(rule, path)`` rows walked in
order (first match wins) over the facts of one all-gather or reduction. Adding a path: its file, and one
row here."""

from __future__ import annotations

from collections.abc import Callable

from .gather import GatherFacts, GatherPath
from .gather_rows import CUSTOM, HPZ_SECONDARY, PACKED, QUANTIZED
from .gather_zero_copy import ZERO_COPY
from .reduce import ReduceFacts, ReducePath
from .reduce_invariant import INVARIANT_TREE, INVARIANT_WHOLE
from .reduce_owner import OWNER_REDUCE, owner_apart
from .reduce_packed import CUSTOM_REDUCE_SCATTER, PACKED_REDUCE_SCATTER
from .reduce_qgz import QGZ
from .reduce_whole import WHOLE
from .reduce_zero_copy import ZERO_COPY_REDUCE_SCATTER

#: the all-gather paths' precedence
GATHER_RULES: list[tuple[Callable[[GatherFacts], bool], GatherPath]] = [
    (lambda f: f.secondary, HPZ_SECONDARY),  # kept rows serve only an all-gather of the same members
    (lambda f: f.custom, CUSTOM),  # the user's collective carries every row
    (lambda f: f.algorithm == "zero_copy" and not f.hpz and f.zero_copy, ZERO_COPY),  # hpZ keeps rows
    (lambda f: f.quantized, QUANTIZED),
    (lambda f: True, PACKED),
]

#: the reduction paths' precedence
REDUCE_RULES: list[tuple[Callable[[ReduceFacts], bool], ReducePath]] = [
    # perparam.invariant at K = 2: the zero-copy sum peer + own is the tree's rank 0 + rank 1 (a + b == b + a)
    (lambda f: f.invariant and f.pair and not f.whole and f.algorithm == "zero_copy" and not f.hpz and f.zero_copy
     and f.cpu, ZERO_COPY_REDUCE_SCATTER),
    (lambda f: f.invariant and not f.whole, INVARIANT_TREE),  # perparam.invariant: tree order at every K
    (lambda f: f.invariant and f.whole, INVARIANT_WHOLE),  # its replicated and stage-1 parameters
    (lambda f: f.whole, WHOLE),  # replicated and stage-1 parameters: all-reduced whole
    (lambda f: f.to_owner and not f.custom, OWNER_REDUCE),  # configure(owner_grad="owner"): whole on the owner
    (lambda f: f.wire is not None, QGZ),  # refuses a custom reduce-scatter
    (lambda f: f.custom, CUSTOM_REDUCE_SCATTER),
    (lambda f: f.algorithm == "zero_copy" and not f.hpz and f.zero_copy and f.cpu, ZERO_COPY_REDUCE_SCATTER),
    (lambda f: True, PACKED_REDUCE_SCATTER),
]


def apart(part) -> Callable | None:
    """The rule taking parameters of ``part`` apart into a reduction of their own now (``(param, whole,
    wire) -> bool``, whose set has ``ReduceFacts.to_owner``), or ``None``: the reduction to the owners'
    (``reduce_owner.owner_apart``), the one path that splits a reduction set."""
    return owner_apart(part)


def gather_path(facts: GatherFacts) -> GatherPath:
    """The path an all-gather with ``facts`` takes: the first row of ``GATHER_RULES`` whose rule holds."""
    return next(path for rule, path in GATHER_RULES if rule(facts))


def reduce_path(facts: ReduceFacts) -> ReducePath:
    """The path a reduction with ``facts`` takes: the first row of ``REDUCE_RULES`` whose rule holds."""
    return next(path for rule, path in REDUCE_RULES if rule(facts))
