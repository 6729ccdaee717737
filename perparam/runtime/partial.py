"""HSDP gradient accumulation with reduce-scatter but no all-reduce (FSDP2's ``set_requires_all_reduce``).

On a 2D (replicate, shard) mesh a group's reduction is a reduce-scatter over the shard axis, then an
all-reduce of its output over the replicate axis (``ParamGroup.advance_reduce``). With
``requires_all_reduce=False`` the reduce-scatter still runs in every backward (the unsharded gradients are
freed: memory of one shard), but its output, this rank's ``[n]`` piece summed over the shard axis, is held
here and summed over the micro-batches; the first reduction with ``requires_all_reduce=True`` adds the held
sum to its own output before its all-reduce, so one all-reduce per reduction key covers every micro-batch.
The division by the part's divisor (``MeshPart.divisor``) and the accumulation into the sharded ``.grad``
happen once, then.

A held sum is keyed by (replicated?, reduce dtype, wire format of a low-precision reduce-scatter,
``ReducePlan.wire``, the path's tail, ``reduction.ReduceTail``): the same reductions a group
issues in every backward. Where each parameter's piece lies in a held sum is the tail's (``pieces``): a
path that leaves another layout (the reduction to the owners: the whole gradients this rank owns, which
the replicate axis' ranks own too) says so there, not here.
The *used* flags at the end of each piece are summed too, so a parameter some rank used in some
micro-batch gets its gradient. On a 1D mesh there is no all-reduce and nothing is held.
"""

from __future__ import annotations

from .reduction import PendingReduce

# ``group`` below is a ``perparam.runtime.part.MeshPart`` (not imported: the part imports this module)


def _key(item: PendingReduce) -> tuple:
    return (item.replicated, item.recv.dtype, item.kind, item.tail)


def hold(group, item: PendingReduce) -> bool:
    """After ``item``'s shard-axis reduction finished on an HSDP group: when the group does not all-reduce
    now, add its output to the held sum and return ``True`` (the reduction is complete: nothing is
    accumulated into ``.grad``); otherwise return ``False``."""
    if group.call.requires_all_reduce or item.discard:
        return False
    # the parameters of a held sum stay in the group's reductions until it is all-reduced, as gradients
    # accumulated without sync do (the call's ``held_unsynced``): one frozen before the next micro-batch
    # adds zeros with a used flag of 0, so every held piece keeps its layout, and the final callback reduces
    # a group that holds a sum even where its forward did not run in the synchronising backward
    group.call.held_unsynced.update(id(p) for p in item.params)
    held = group.partial_reduce.get(_key(item))
    if held is None:
        group.partial_reduce[_key(item)] = _HeldSum(item.params, item.offsets, item.recv, item.replicated)
    else:
        held.tensor = _laid_out(held, item).add_(item.recv)
        held.params, held.offsets = item.params, item.offsets
    return True


def merge(group, item: PendingReduce) -> None:
    """Before ``item``'s all-reduce over the replicate axis: add (and drop) the sum held for its key."""
    held = group.partial_reduce.pop(_key(item), None)
    if held is not None and not item.discard:
        item.recv.add_(_laid_out(held, item))


class _HeldSum:
    """A held sum: the reduction output ``tensor`` of ``params`` (pieces at ``offsets``, then the flags:
    ``PendingReduce.flag_rows``); ``replicated`` as its reductions' (what the tail's ``pieces`` read)."""

    __slots__ = ("params", "offsets", "tensor", "replicated")

    def __init__(self, params: tuple, offsets: tuple[int, ...], tensor, replicated: bool) -> None:
        self.params, self.offsets, self.tensor, self.replicated = params, offsets, tensor, replicated


def _laid_out(held: _HeldSum, item: PendingReduce):
    """``held``'s sum in ``item``'s layout: itself when the parameters are the same; else (a parameter
    unfrozen between micro-batches joins the reduction; a held one never leaves it) each held piece and used
    flag copied to its place among ``item``'s, zeros for the others."""
    if len(held.params) == len(item.params) and all(a is b for a, b in zip(held.params, item.params)):
        return held.tensor
    where = {id(p): j for j, p in enumerate(item.params)}
    out = item.recv.new_zeros(item.recv.shape)
    new = item.tail.pieces(item)
    old = item.tail.pieces(held)
    rows = item.flag_rows  # rows of flags at the end: the used flags last (and any the path adds before them)
    flags_at = item.recv.numel() - rows * len(item.params)
    held_flags_at = held.tensor.numel() - rows * len(held.params)
    for i, p in enumerate(held.params):
        j = where[id(p)]
        out.narrow(0, new[j][0], old[i][1]).copy_(held.tensor.narrow(0, *old[i]))
        for r in range(rows):
            out[flags_at + r * len(item.params) + j] = held.tensor[held_flags_at + r * len(held.params) + i]
    return out


def held_bytes(group) -> int:
    """Bytes of reduce-scattered gradients this rank holds for a later all-reduce."""
    return sum(h.tensor.numel() * h.tensor.element_size() for h in group.partial_reduce.values())
