"""Reducing gradients accumulated without sync outside a backward: what a pipeline schedule's REDUCE_GRAD
action needs (torch's stage calls FSDP2's ``post_backward`` and final callback for it).

A pipeline stage runs every micro-batch's backward with ``set_requires_gradient_sync(False)``, so each
group's gradients stay in its unsharded accumulators (``ShardedParam.grad_acc``); once the schedule has
run the last backward it asks for the reduction, with no backward left to carry it. ``reduce_accumulated``
issues it as a synchronising backward's final callback would: the groups in a fixed order (the same on
every rank), each group's usual collectives (one reduce-scatter per reduce dtype, HSDP all-reduce,
replicated all-reduces), every trainable parameter packed whatever this rank computed.
"""

from __future__ import annotations

from .group import ParamGroup
from .state import StateError, TrainingState


def reduce_accumulated(groups: list[ParamGroup]) -> int:
    """Reduce into the sharded ``.grad``s what ``groups`` accumulated without sync, then reshard the groups
    that reshard after backward. ``groups``: in an order that is the same on every rank (module order).
    A group with nothing accumulated issues nothing (on every rank alike: whether a group accumulated
    depends only on whether its forward ran with grad, not on what a rank computed). Returns the number of
    groups reduced.

    Raises ``StateError`` when a group is in the middle of a forward or backward, or while gradient sync
    is off for a group holding accumulated gradients (nothing would be reduced)."""
    due = []
    for g in groups:
        if g.state is not TrainingState.IDLE or g.ctx.callback_queued:
            raise StateError(f"perparam: {g.own._what} is in {g.state.value}; reduce accumulated gradients "
                             "after the last backward of the step has finished")
        if g.unsynced and not g.requires_gradient_sync:
            raise StateError(f"perparam: {g.own._what} holds gradients accumulated without sync and gradient "
                             "sync is still off; call set_requires_gradient_sync(True) first")
        if g.unsynced:
            due.append(g)
    contexts = {}
    for g in due:
        contexts.setdefault(id(g.ctx), g.ctx)
        g.ctx.add_pending(g, g.reduce_grads(sync=True, defer=True))
    for ctx in contexts.values():
        ctx.finish_pending()
    for g in groups:
        if g.reshard_after_backward and not g.registered_unsharded:
            g.free()
    for ctx in contexts.values():
        ctx.run_grad_hooks()
    return len(due)
