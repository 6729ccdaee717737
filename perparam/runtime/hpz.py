"""hpZ, ZeRO++'s secondary partition (FSDP2's ``reshard_after_forward=int``): after forward a group keeps
its parameters sharded over a smaller group of ranks, so the backward all-gather runs on that group only
(``paths.gather_hpz``). This file is the partition's state: its meshes and the rows a rank keeps.

With K ranks on the shard axis and a secondary size k' (a divisor of K, 1 < k' < K), the ranks split into
groups of k' consecutive shard ranks (as FSDP2's post-forward mesh: the mesh's ranks viewed as
``(-1, k')``; on a 2D HSDP mesh within each shard row). The forward all-gather over the K ranks delivers
every rank's row of the packed uint8 buffer (``[K, slot]``, ``perparam.sharding.layout.GroupLayout``);
member j of a secondary group keeps rows ``j * K/k' .. (j + 1) * K/k' - 1`` of it, ``K/k' * slot`` bytes,
i.e. 1/k' of the group's gathered bytes P (ZeRO++'s extra P/k' per rank). In backward the members
all-gather those kept rows over the k' ranks; concatenated in member order they are the K rows again, in
rank order, and are copied out exactly as after the forward all-gather (quantized pieces included: what
is kept is what was on the wire). The kept rows are dropped once gathered, at any other reshard, and
when the shards changed since (an optimizer step): the backward all-gather then runs over the K ranks.
"""

from __future__ import annotations

import threading
import weakref

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

#: default process group (one per rank, also for ranks that are threads of one process) -> {(device type,
#: the mesh's ranks, k') -> the secondary DeviceMesh}, shared by the groups of one layout (one set of
#: process groups for all the blocks of a model, not one per ``fully_shard`` call). Keyed per rank, never
#: per process: a thread rank that found a peer thread's mesh would skip its own ``new_group`` and leave
#: the others waiting in theirs.
_MESHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def secondary_mesh(mesh: DeviceMesh, size: int) -> DeviceMesh:
    """The ``DeviceMesh`` over ``mesh``'s ranks viewed as ``(-1, size)``; its dim 1 groups are the secondary
    groups. Created by the first call (every rank, in the same order), looked up afterwards; created again
    once its process groups were destroyed."""
    with _lock:
        meshes = _MESHES.setdefault(dist.distributed_c10d._world.default_pg, {})
    key = (mesh.device_type, tuple(mesh.mesh.reshape(-1).tolist()), size)
    found = meshes.get(key)
    if found is not None:
        try:
            alive = found.get_group(1) in dist.distributed_c10d._world.pg_map
        except (RuntimeError, ValueError, KeyError):  # its groups were destroyed (a new process group)
            alive = False
        if not alive:
            found = None
    if found is None:
        found = meshes[key] = DeviceMesh(mesh.device_type, mesh.mesh.reshape(-1, size))
    return found


class Secondary:
    """The secondary partition of one group: its size, this rank's place in it, the rows kept.

    ``mesh``: the group's dp mesh (1D, or 2D (replicate, shard)); ``size``: k'. Creating it creates the
    secondary process groups the first time (``secondary_mesh``): every rank must create it, in the same
    order (``fully_shard`` does)."""

    def __init__(self, mesh: DeviceMesh, size: int) -> None:
        num_shards = mesh.size(mesh.ndim - 1)
        self.size = size
        self.rows_per_member = num_shards // size
        self.member = mesh.get_coordinate()[-1] % size
        self.mesh = secondary_mesh(mesh, size)
        self.kept: torch.Tensor | None = None  # uint8 [rows_per_member, slot]

    @property
    def pg(self):
        return self.mesh.get_group(1)

    def kept_bytes(self) -> int:
        """Bytes of the secondary shard this rank holds now (0 when none)."""
        return 0 if self.kept is None else self.kept.numel()

    def keep(self, segments: list[tuple[int, torch.Tensor]], pool) -> None:
        """Copy this member's rows out of a finished all-gather over the K ranks (``GatheredRows.segments``:
        ``(first rank, [m, slot] rows)``, rank order) into a buffer from ``pool``."""
        lo, hi = self.member * self.rows_per_member, (self.member + 1) * self.rows_per_member
        slot = segments[0][1].shape[1]
        if self.kept is None:
            self.kept = pool.take(self.rows_per_member * slot,
                                  segments[0][1].device).view(self.rows_per_member, slot)
        for first, rows in segments:
            a, b = max(lo, first), min(hi, first + rows.shape[0])
            if a < b:
                self.kept[a - lo:b - lo].copy_(rows[a - first:b - first])

    def usable(self, fresh: bool, pool) -> bool:
        """Whether the next unshard can all-gather over the secondary group: rows are kept and ``fresh`` (the
        shards have not changed since they were gathered); stale rows are dropped."""
        if self.kept is not None and not fresh:
            self.drop(pool)
        return self.kept is not None

    def hand_over(self) -> torch.Tensor:
        """The kept rows (uint8 ``[rows_per_member, slot]``), no longer this object's: the secondary
        all-gather (``paths.gather_hpz``) gives the buffer back to the pool once it is copied out."""
        kept, self.kept = self.kept, None
        return kept

    def drop(self, pool) -> None:
        if self.kept is not None:
            pool.give_back(self.kept)
            self.kept = None
