"""Gradient reductions run on process groups of their own, apart from the all-gathers.

Collectives on one process group must be issued in the same order on every rank. The all-gathers follow
the forward order and, in backward, a fixed expected order; the reductions follow the reverse forward
order, each issued once a group's backward is done on this rank. Both sequences are the same on every
rank, but how they interleave depends on how far each rank's backward has got (a rank whose output of a
branch is unused finishes it sooner). Giving the reductions a process group over the same ranks
(``dist.new_group(..., use_local_synchronization=True)``, created at ``fully_shard`` time, once per
group of ranks) makes the two sequences independent, so the interleaving no longer matters. On NCCL this
costs one more communicator per group of ranks.
"""

from __future__ import annotations

import weakref

import torch.distributed as dist
from torch.distributed import ProcessGroup

#: weak: c10d holds each group until ``destroy_process_group()``; perparam never keeps one alive past it
_REDUCE_GROUPS: weakref.WeakValueDictionary[str, ProcessGroup] = weakref.WeakValueDictionary()


def _alive(pg: ProcessGroup) -> bool:
    return pg in dist.distributed_c10d._world.pg_map


def reduce_group(pg: ProcessGroup | None, purpose: str = "reduce") -> ProcessGroup | None:
    """The process group for gradient reductions over ``pg``'s ranks (``pg`` itself when it has one rank),
    one per ``purpose``: ``"reduce"`` for the reduce-scatters and the HSDP all-reduces that follow them,
    ``"replicated"`` for the all-reduces of replicated parameters' gradients over the replicate axis.

    Those two must not share a group: a sharded reduction's HSDP all-reduce is issued when its
    reduce-scatter is seen to have finished (polled, never waited for in backward), so where it falls
    between a later group's replicated all-reduces depends on timing, and differs between ranks (seen:
    gloo aborting with "Received data size doesn't match expected size" on a 3 x 1 HSDP mesh).

    Must first be called by every rank of ``pg`` in the same order (``fully_shard`` does); later calls
    look the group up."""
    if pg is None or pg.size() == 1:
        return pg
    key = f"{pg.group_name}/{purpose}"
    dup = _REDUCE_GROUPS.get(key)
    if dup is None or not _alive(dup):
        desc = f"perparam_{purpose}_{pg.group_desc}" if hasattr(pg, "group_desc") else None
        dup = dist.new_group(ranks=dist.get_process_group_ranks(pg), use_local_synchronization=True,
                             group_desc=desc)
        _REDUCE_GROUPS[key] = dup
    return dup
