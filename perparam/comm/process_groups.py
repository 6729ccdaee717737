"""Gradient reductions run on process groups of their own, apart from the all-gathers.

Collectives on one process group must be issued in the same order on every rank. The all-gathers follow
the forward order and, in backward, a fixed expected order; the reductions follow the reverse forward
order, each issued once a group's backward is done on this rank. Both sequences are the same on every
rank, but how they interleave depends on how far each rank's backward has got (a rank whose output of a
branch is unused finishes it sooner). Giving the reductions a process group over the same ranks
(``dist.new_group(..., use_local_synchronization=True)``, created at ``fully_shard`` time, once per
process group) makes the two sequences independent, so the interleaving no longer matters. On NCCL this
costs one more communicator per group of ranks, and on CUDA it relies on the two communicators' kernels
not sharing one hardware queue (``serialised_streams_warning``). One order on every rank instead would make
a rank wait at a fixed point for a reduction its backward has not reached, which is the deadlock the
rank-dependent-use tests rule out; FSDP2 can keep one group because it requires every rank's backward to
reach every group in the same order (torch 2.13 also offers a separate reduce-scatter group,
``FSDPModule.set_separate_reduce_scatter_group``).

The cache is keyed by the ``ProcessGroup`` object, never by its name or by the process: when ranks run as
threads of one process (torch's ``threaded`` backend of
``torch.testing._internal.distributed.multi_threaded_pg``, simulators) every thread has its own world with
the same group names, and each rank must create its own reduction group (``new_group`` waits for all of
them).
"""

from __future__ import annotations

import itertools
import os
import threading
import warnings
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
                             group_desc=f"perparam_reduce_{pg.group_desc}" if hasattr(pg, "group_desc")
                             else None)
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


#: pg -> True once its communicator was warmed up (``warm_up``); weak: a destroyed world takes its groups
_WARM: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: default process group -> the names of the groups this rank warmed up, in order (what the tests compare)
_WARM_ORDER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def warm_up(groups, device_type: str) -> None:
    """Create the communicators of ``groups`` (process groups or ``None``, skipped) now, in the order given:
    one 1-element all-reduce on each group not warmed up before, waited for.

    NCCL creates a process group's communicator at its first collective, a handshake of every rank of the
    group; left to the first use, that first use comes at a different moment on different ranks (the
    reductions are issued as each rank's backward gets there) while a rank can be blocked elsewhere. Called
    by ``fully_shard`` on every group its parameters will use, which every rank calls in the same order, so
    every rank creates them in the same order before any step. On gloo (connected when the group is created)
    this is one cheap all-reduce per group, kept so the CPU tests run the same path. ``device_type``: the
    mesh's (the tensor is on that device type's current device)."""
    import torch

    groups = list(dict.fromkeys(pg for pg in groups if pg is not None and pg not in _WARM and pg.size() > 1))
    message = serialised_streams_warning(device_type, os.environ) if groups else None
    if message is not None and not _WARNED:
        _WARNED.append(True)
        warnings.warn(message, stacklevel=3)
    for pg in groups:
        if device_type == "cpu":
            device = torch.device("cpu")
        else:
            device = torch.device(device_type, torch.get_device_module(device_type).current_device())
        dist.all_reduce(torch.zeros(1, device=device), group=pg)
        _WARM[pg] = True
        world = dist.distributed_c10d._world.default_pg if dist.is_initialized() else None
        if world is not None:
            with _lock:
                _WARM_ORDER.setdefault(world, []).append(pg.group_name)


_WARNED: list = []  # once per process


def serialised_streams_warning(device_type: str, env) -> str | None:
    """The warning for a device mesh whose CUDA streams share one hardware queue
    (``CUDA_DEVICE_MAX_CONNECTIONS=1`` in ``env``), else ``None``.

    perparam's all-gathers and reductions run on two communicators (this module's docstring), each in an
    order that is the same on every rank, but how the two interleave can differ by rank. NCCL kernels wait
    for their peers on the device; on one hardware queue a reduction kernel can sit behind an all-gather
    kernel that waits for a peer whose own all-gather sits behind its reduction: a deadlock. With several
    connections (CUDA's default, 8) the two communicators' kernels are on different queues."""
    if device_type == "cpu" or str(env.get("CUDA_DEVICE_MAX_CONNECTIONS", "")).strip() != "1":
        return None
    return ("perparam: CUDA_DEVICE_MAX_CONNECTIONS=1 serialises the CUDA streams, and perparam runs "
            "all-gathers and gradient reductions on two NCCL communicators whose interleaving may differ "
            "between ranks (a rank's backward reaches a group's reduction when its own autograd does): their "
            "kernels can then wait on each other across ranks and hang. Unset CUDA_DEVICE_MAX_CONNECTIONS "
            "(or set it above 1) for perparam's ranks")


def warmed_up() -> list[str]:
    """The names of the process groups this rank warmed up (``warm_up``), in order."""
    world = dist.distributed_c10d._world.default_pg if dist.is_initialized() else None
    return list(_WARM_ORDER.get(world, [])) if world is not None else []
