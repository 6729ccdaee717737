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


def reduce_group(pg: ProcessGroup | None) -> ProcessGroup | None:
    """The process group for gradient reductions over ``pg``'s ranks (``pg`` itself when it has one rank).

    Must first be called by every rank of ``pg`` in the same order (``fully_shard`` does); later calls
    look the group up."""
    if pg is None or pg.size() == 1:
        return pg
    dup = _REDUCE_GROUPS.get(pg.group_name)
    if dup is None or not _alive(dup):
        dup = dist.new_group(ranks=dist.get_process_group_ranks(pg), use_local_synchronization=True,
                             group_desc=f"perparam_reduce_{pg.group_desc}" if hasattr(pg, "group_desc") else None)
        _REDUCE_GROUPS[pg.group_name] = dup
    return dup
