"""HSDP gradient accumulation with reduce-scatter but no all-reduce (FSDP2's ``set_requires_all_reduce``).

On a 2D (replicate, shard) mesh a group's reduction is a reduce-scatter over the shard axis, then an
all-reduce of its output over the replicate axis (``ParamGroup.advance_reduce``). With
``requires_all_reduce=False`` the reduce-scatter still runs in every backward (the unsharded gradients are
freed: memory of one shard), but its output, this rank's ``[n]`` piece summed over the shard axis, is held
here and summed over the micro-batches; the first reduction with ``requires_all_reduce=True`` adds the held
sum to its own output before its all-reduce, so one all-reduce per reduction key covers every micro-batch.
The division by the group's divisor and the accumulation into the sharded ``.grad`` happen once, then.

A held sum is keyed by (replicated?, reduce dtype, wire format of a low-precision reduce-scatter,
``perparam.runtime.grad_quant``): the same reductions a group issues in every backward.
The *used* flags at the end of each piece are summed too, so a parameter some rank used in some
micro-batch gets its gradient. On a 1D mesh there is no all-reduce and nothing is held.
"""

from __future__ import annotations

from .reduction import PendingReduce

# ``group`` below is a ``perparam.runtime.part.MeshPart`` (not imported: the part imports this module)


def _key(item: PendingReduce) -> tuple:
    return (item.replicated, item.recv.dtype, item.kind)


def hold(group, item: PendingReduce) -> bool:
    """After ``item``'s shard-axis reduction finished on an HSDP group: when the group does not all-reduce
    now, add its output to the held sum and return ``True`` (the reduction is complete: nothing is
    accumulated into ``.grad``); otherwise return ``False``."""
    if group.call.requires_all_reduce or item.discard:
        return False
    held = group.partial_reduce.get(_key(item))
    if held is None:
        group.partial_reduce[_key(item)] = item.recv
    elif held.numel() != item.recv.numel():
        raise RuntimeError(
            f"perparam: {group._what}: the gradients held without all-reduce (set_requires_all_reduce(False)) "
            f"came from {held.numel()} elements, this reduction has {item.recv.numel()}: the group's trainable "
            "parameters changed between micro-batches. Change requires_grad only after a backward with "
            "set_requires_all_reduce(True)")
    else:
        held.add_(item.recv)
    return True


def merge(group, item: PendingReduce) -> None:
    """Before ``item``'s all-reduce over the replicate axis: add (and drop) the sum held for its key."""
    held = group.partial_reduce.pop(_key(item), None)
    if held is not None and not item.discard:
        item.recv.add_(held)


def held_bytes(group) -> int:
    """Bytes of reduce-scattered gradients this rank holds for a later all-reduce."""
    return sum(t.numel() * t.element_size() for t in group.partial_reduce.values())
