"""The zero-copy all-gather: a group's unsharded parameters receive the other ranks' pieces straight into
their padded buffers, so nothing is copied out of a gathered row buffer afterwards.

With ``perparam.configure(gloo_all_gather="zero_copy")`` on gloo on CPU, an all-gather whose members are all
plain ``Shard(0)`` parameters (``ShardedParam.plain`` and ``layout.wire_is_layout``: the K pieces are the
buffer's rows, in rank order) runs as per-parameter point-to-point sends and receives
(``perparam.comm.collectives.all_gather_in_place``): each rank copies (and casts) its local shard into its
own rows of the buffer, sends those rows to every peer and receives each peer's rows in place. Bytes moved:
the local shards, once to each peer; copies: the copy-in only (the row path also copies every gathered
row out). Every other all-gather (quantized pieces, ``Shard(d > 0)``, a custom all-gather, hpZ, which keeps
the gathered rows, other backends, K = 1) takes the packed row path (``perparam.runtime.paths.gather_rows``).
Why per-parameter transfers and not one collective: in one collective each rank's contribution lands in
one contiguous region, so only a group of one parameter could get contiguous unsharded parameters from it;
the measurements are in ``benchmarks/README.md``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import collectives
from .param import ShardedParam


def wanted(algorithm: str, comm, hpz) -> bool:
    """The runtime's settings allow a zero-copy all-gather: ``algorithm`` (``config.gloo_all_gather``) is
    ``"zero_copy"``, no custom all-gather ``comm`` and no hpZ ``hpz`` (it keeps the gathered rows). Read at
    every unshard (``perparam.configure`` applies from the next collective on)."""
    return algorithm == "zero_copy" and comm is None and hpz is None


def eligible(members: list[ShardedParam], group: dist.ProcessGroup) -> bool:
    """What never changes for one set of parameters: K > 1 on gloo and every member plain ``Shard(0)``
    (``ShardedParam.plain`` and ``layout.wire_is_layout``). ``MeshPart`` asks once per member set and
    keeps the answer (``MeshPart._gather_plan``)."""
    if group.size() == 1 or dist.get_backend(group) != "gloo":
        return False
    return all(p.plain and p.layout.wire_is_layout for p in members)


def applies(members: list[ShardedParam], group: dist.ProcessGroup, algorithm: str, comm, hpz) -> bool:
    """Whether the all-gather of ``members`` over ``group`` runs zero-copy (see the module docstring):
    ``wanted``, ``eligible`` and every local shard on the CPU (the one condition ``start`` reads at each
    unshard: ``to_empty``, ``.to`` or a ``.data`` swap may move a shard)."""
    return (wanted(algorithm, comm, hpz) and eligible(members, group)
            and all(p.local_shard().device.type == "cpu" for p in members))


def start(members: list[ShardedParam], group: dist.ProcessGroup, slot_bytes: int,
          what: str) -> collectives.GatheredRows | None:
    """Allocate each member's padded buffer, copy (and cast to the compute dtype) this rank's local shard
    into its own rows, and issue the in-place all-gather (``collectives.all_gather_in_place``; recorded as
    one all-gather of ``K * slot_bytes``, the group layout's figure). Wait on the returned handle before
    reading the parameters. ``members`` must be ``eligible``; ``None`` (nothing issued, some buffers
    allocated) when a local shard is not on the CPU: the caller takes the row path."""
    regions, dsts, srcs = [], [], []
    for p in members:
        src = p.local_shard()
        if src.device.type != "cpu":
            return None
        p.alloc()
        per_rank, own = p.rank_regions()
        regions.append(per_rank)
        if own is not None and own.data_ptr() != src.data_ptr():  # (a shard viewing its rows: there already)
            dsts.append(own)
            srcs.append(src)
    if dsts:
        with torch.no_grad():
            torch._foreach_copy_(dsts, srcs)
    return collectives.all_gather_in_place(regions, group, slot_bytes, what=what, async_op=True)
