"""Which all-gathers a group's hooks issue ahead of need: the recorded order or the user's lists.

By default a group's pre-forward prefetches the group that ran after it in the last forward, and the
backward all-gathers follow the fixed order (root, reverse forward order) one group ahead
(``perparam.runtime.hooks``). ``ShardedModule.set_modules_to_forward_prefetch`` /
``set_modules_to_backward_prefetch`` (FSDP2's names) replace that for one group with a list of groups
(``ParamGroup.forward_prefetch`` / ``backward_prefetch``; ``None``: the recorded order).

Every rank must issue the same all-gathers in the same order whatever its backward computed, so explicit
backward prefetches are not issued from a group's own pre-backward alone (a rank whose backward skips that
group would never issue them): they are part of the fixed backward sequence, right after their group,
and whichever rank reaches that point of the sequence (by that group's pre-backward or a later one's)
issues them there.
"""

from __future__ import annotations

from .group import ParamGroup


class PrefetchError(ValueError):
    """An explicit prefetch list names a group outside the model it would run in."""


def check_targets(tree: list[ParamGroup]) -> None:
    """Raise ``PrefetchError`` when a group of ``tree`` (a root's groups) lists a group of another model
    (its all-gather would run in an iteration that does not follow it)."""
    members = {id(g) for g in tree}
    for g in tree:
        for kind, targets in (("forward", g.forward_prefetch), ("backward", g.backward_prefetch)):
            for t in targets or ():
                if id(t) not in members:
                    raise PrefetchError(
                        f"perparam: {g.path or g.name}.set_modules_to_{kind}_prefetch lists [{t.name}] "
                        f"({', '.join(p.path for p in t.params)}), which is not sharded inside the model of "
                        f"root [{tree[0].name}]; list only sharded modules of the same model (or call it "
                        "with [] to restore the recorded order)")


def forward_targets(group: ParamGroup, recorded_next: ParamGroup | None, lookahead: bool) -> list[ParamGroup]:
    """The groups ``group``'s pre-forward prefetches, in order: its explicit list, else the group that ran
    after it in the last forward (when ``lookahead``, i.e. ``perparam.configure(prefetch=True)``)."""
    if group.forward_prefetch is not None:
        return group.forward_prefetch
    return [recorded_next] if lookahead and recorded_next is not None else []


def backward_sequence(order: list[ParamGroup], lookahead: bool) -> tuple[list[ParamGroup], dict, dict]:
    """The backward all-gather sequence for the expected backward ``order`` (root, reverse forward order):
    each group followed by the groups of its explicit list not yet in the sequence (only groups of
    ``order``: the others have no backward here). Returns ``(sequence, index, stop)``: a group's position,
    and how far the sequence is issued once it starts its backward: past its explicit targets, or with
    the recorded order one group beyond it (``lookahead``) or up to itself. The same on every rank."""
    sequence: list[ParamGroup] = []
    index: dict[ParamGroup, int] = {}
    members = set(order)

    def add(g: ParamGroup) -> None:
        if g not in index:
            index[g] = len(sequence)
            sequence.append(g)

    for g in order:
        add(g)
        for t in g.backward_prefetch or ():
            if t in members:
                add(t)
    stop = {}
    for g in order:
        if g.backward_prefetch is None:
            end = index[g] + (2 if lookahead else 1)
        else:
            end = max([index[g]] + [index[t] for t in g.backward_prefetch if t in members]) + 1
        stop[g] = min(end, len(sequence))
    return sequence, index, stop
