"""The only place a path is picked: one chooser per seam, each a table of ``(rule, path)`` rows walked in
order (first match wins) over the facts of one all-gather or reduction (``GatherFacts``, ``ReduceFacts``).

Adding a path: its file, and one row in ``GATHER_RULES`` or ``REDUCE_RULES`` here. A row can also be added
from outside this file, for a path defined elsewhere (a test, an experiment), through ``Rules.add``:
``REDUCE_RULES.add(rule, path, before="packed reduce-scatter")`` puts the row before the first row of the
path so named (``before=None``: first of all) and returns a ``Row`` whose ``remove()`` (or the end of a
``with`` block) takes it out again. A part keeps the path chosen per set and facts, and asks again after
the table changed (``Rules.version``)."""

from __future__ import annotations

from collections.abc import Callable

from .gather import GatherFacts, GatherPath
from .gather_hpz import HPZ_SECONDARY
from .gather_rows import CUSTOM, PACKED, QUANTIZED
from .gather_zero_copy import ZERO_COPY
from .gather_zero_copy import eligible as gather_zero_copy_eligible
from .reduce import ReduceFacts, ReducePath
from .reduce_invariant import INVARIANT_TREE, INVARIANT_WHOLE
from .reduce_owner import OWNER_REDUCE, owner_apart
from .reduce_packed import CUSTOM_REDUCE_SCATTER, PACKED_REDUCE_SCATTER
from .reduce_qgz import QGZ
from .reduce_whole import WHOLE
from .reduce_zero_copy import ZERO_COPY_REDUCE_SCATTER
from .reduce_zero_copy import eligible as reduce_zero_copy_eligible


class Row:
    """One row added by ``Rules.add``: ``remove()`` takes it out of its table (once; again is a no-op); as a
    context manager, removed at the end of the block."""

    def __init__(self, rules: Rules, row: tuple) -> None:
        self.rules, self.row = rules, row

    def remove(self) -> None:
        if any(r is self.row for r in self.rules.rows):
            self.rules.rows = [r for r in self.rules.rows if r is not self.row]
            self.rules.version += 1

    def __enter__(self) -> Row:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


class Rules:
    """A chooser's table: ``rows``, ``(rule, path)`` in precedence order (``rule``: facts -> bool, ``path``
    an object of the seam's protocol with a ``name``), and ``version``, which changes with them."""

    def __init__(self, rows: list[tuple[Callable, object]]) -> None:
        self.rows = list(rows)
        self.version = 0

    def __iter__(self):
        return iter(self.rows)

    def add(self, rule: Callable, path, *, before: str | None = None) -> Row:
        """Add the row ``(rule, path)`` before the first row whose path is named ``before`` (``None``: before
        every row). Raises ``ValueError`` when no row's path has that name."""
        names = [p.name for _, p in self.rows]
        if before is not None and before not in names:
            raise ValueError(f"perparam: no path named {before!r} in this table; the names: {names}")
        at = 0 if before is None else names.index(before)
        row = (rule, path)
        self.rows = [*self.rows[:at], row, *self.rows[at:]]
        self.version += 1
        return Row(self, row)

    def choose(self, facts, cache: dict | None = None):
        """The path of the first row whose rule holds for ``facts``; ``cache`` (a plan's dict) keeps it per
        facts for this ``version`` of the table."""
        if cache is not None:
            hit = cache.get(facts)
            if hit is not None and hit[0] == self.version:
                return hit[1]
        path = next(path for rule, path in self.rows if rule(facts))
        if cache is not None:
            cache[facts] = (self.version, path)
        return path


#: the all-gather paths' precedence
GATHER_RULES = Rules([
    (lambda f: f.secondary, HPZ_SECONDARY),  # kept rows serve only an all-gather of the same members
    (lambda f: f.custom, CUSTOM),  # the user's collective carries every row
    (lambda f: f.algorithm == "zero_copy" and not f.hpz and f.zero_copy, ZERO_COPY),  # hpZ keeps rows
    (lambda f: f.quantized, QUANTIZED),
    (lambda f: True, PACKED),
])

#: the reduction paths' precedence
REDUCE_RULES = Rules([
    # perparam.invariant at K = 2: the zero-copy sum peer + own is the tree's rank 0 + rank 1 (a + b == b + a)
    (lambda f: f.invariant and f.pair and not f.whole and f.algorithm == "zero_copy" and not f.hpz
     and f.zero_copy and f.cpu, ZERO_COPY_REDUCE_SCATTER),
    (lambda f: f.invariant and not f.whole, INVARIANT_TREE),  # perparam.invariant: tree order at every K
    (lambda f: f.invariant and f.whole, INVARIANT_WHOLE),  # its replicated and stage-1 parameters
    (lambda f: f.whole, WHOLE),  # replicated and stage-1 parameters: all-reduced whole
    (lambda f: f.to_owner and not f.custom, OWNER_REDUCE),  # configure(owner_grad="owner"): whole on owners
    (lambda f: f.wire is not None, QGZ),  # refuses a custom reduce-scatter
    (lambda f: f.custom, CUSTOM_REDUCE_SCATTER),
    (lambda f: f.algorithm == "zero_copy" and not f.hpz and f.zero_copy and f.cpu, ZERO_COPY_REDUCE_SCATTER),
    (lambda f: True, PACKED_REDUCE_SCATTER),
])


def gather_set_facts(part, members) -> dict:
    """The ``GatherFacts`` fields fixed for one member set (``ShardedParam``s of ``part``, a ``MeshPart``),
    worked out once per set by the paths that read them: ``zero_copy``."""
    return {"zero_copy": gather_zero_copy_eligible(members, part.shard_pg)}


def reduce_set_facts(part, params) -> dict:
    """The ``ReduceFacts`` fields fixed for one reduction set (``ShardedParam``s of ``part``), worked out
    once per set by the paths that read them: ``zero_copy``."""
    return {"zero_copy": reduce_zero_copy_eligible(params, part.reduce_shard_pg)}


def apart(part) -> Callable | None:
    """The rule taking parameters of ``part`` apart into a reduction of their own now (``(param, whole,
    wire) -> bool``, whose set has ``ReduceFacts.to_owner``), or ``None``: the reduction to the owners'
    (``reduce_owner.owner_apart``), the one path that splits a reduction set."""
    return owner_apart(part)


def gather_path(facts: GatherFacts, cache: dict | None = None) -> GatherPath:
    """The path an all-gather with ``facts`` takes: the first row of ``GATHER_RULES`` whose rule holds
    (``cache``: see ``Rules.choose``)."""
    return GATHER_RULES.choose(facts, cache)


def reduce_path(facts: ReduceFacts, cache: dict | None = None) -> ReducePath:
    """The path a reduction with ``facts`` takes: the first row of ``REDUCE_RULES`` whose rule holds
    (``cache``: see ``Rules.choose``)."""
    return REDUCE_RULES.choose(facts, cache)
