"""Gradient reductions run on process groups of their own, apart from the all-gathers.

Collectives on one process group must be issued in the same order on every rank. The all-gathers follow
the forward order and, in backward, a fixed expected order; the reductions follow the reverse forward
order, each issued once a group's backward is done on this rank. Both sequences are the same on every
rank, but how they interleave depends on how far each rank's backward has got (a rank whose output of a
branch is unused finishes it sooner). Giving the reductions a process group over the same ranks
(``dist.new_group(..., use_local_synchronization=True)``, created at ``fully_shard`` time, once per
process group) makes the two sequences independent, so the interleaving no longer matters. On NCCL this
costs one more communicator per group of ranks.

The cache is keyed by the ``ProcessGroup`` object, never by its name or by the process: when ranks run as
threads of one process (torch's ``threaded`` backend of
``torch.testing._internal.distributed.multi_threaded_pg``, simulators) every thread has its own world with
the same group names, and each rank must create its own reduction group (``new_group`` waits for all of
them).
"""

from __future__ import annotations

import itertools
import threading
import weakref

import torch.distributed as dist
from torch.distributed import ProcessGroup

#: pg -> weak reference to its reduction group. Weak on both sides: c10d holds each group until
#: ``destroy_process_group()``; perparam never keeps one alive past it
_REDUCE_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: default process group (one per rank, also for ranks that are threads) -> its counter of ``ParamGroup``s
_COUNTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_NO_WORLD = itertools.count()  # before init_process_group (fake or no process group)
_lock = threading.Lock()


def _alive(pg: ProcessGroup) -> bool:
    return pg in dist.distributed_c10d._world.pg_map


def reduce_group(pg: ProcessGroup | None) -> ProcessGroup | None:
    """The process group for gradient reductions over ``pg``'s ranks (``pg`` itself when it has one rank).

    Must first be called by every rank of ``pg`` in the same order (``fully_shard`` does); later calls
    look the group up."""
    if pg is None or pg.size() == 1:
        return pg
    ref = _REDUCE_GROUPS.get(pg)
    dup = ref() if ref is not None else None
    if dup is None or not _alive(dup):
        dup = dist.new_group(ranks=dist.get_process_group_ranks(pg), use_local_synchronization=True,
                             group_desc=f"perparam_reduce_{pg.group_desc}" if hasattr(pg, "group_desc") else None)
        _REDUCE_GROUPS[pg] = weakref.ref(dup)
    return dup


def next_group_index() -> int:
    """The creation index of a new ``ParamGroup`` among this rank's (0, 1, ...; counted per default process
    group, so ranks that are threads of one process each count their own): the same on every rank that
    builds the same model."""
    world = dist.distributed_c10d._world.default_pg if dist.is_initialized() else None
    if world is None:
        return next(_NO_WORLD)
    with _lock:
        counter = _COUNTERS.setdefault(world, itertools.count())
    return next(counter)
