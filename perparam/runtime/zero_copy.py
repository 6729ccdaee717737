"""The zero-copy all-gather: a group's unsharded parameters receive the other ranks' pieces straight into
their padded buffers, so nothing is copied out of a gathered row buffer afterwards.

With ``perparam.configure(gloo_all_gather="zero_copy")`` on gloo on CPU, an all-gather whose members are all
plain ``Shard(0)`` parameters (``ShardedParam.plain`` and ``layout.wire_is_layout``: the K pieces are the
buffer's rows, in rank order) runs as per-parameter point-to-point sends and receives
(``perparam.comm.collectives.all_gather_in_place``): each rank copies (and casts) its local shard into its
own rows of the buffer, sends those rows to every peer and receives each peer's rows in place. Bytes moved:
the local shards, once to each peer; copies: the copy-in only (the row path also copies every gathered
row out). Every other all-gather (quantized pieces, ``Shard(d > 0)``, a custom all-gather, hpZ, which keeps
the gathered rows, other backends, K = 1) takes the packed row path of ``ParamGroup.start_unshard``.
Why per-parameter transfers and not one collective: in one collective each rank's contribution lands in
one contiguous region, so only a group of one parameter could get contiguous unsharded parameters from it;
the measurements are in ``benchmarks/README.md``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import collectives
from .param import ShardedParam


def applies(members: list[ShardedParam], group: dist.ProcessGroup, algorithm: str, comm, hpz) -> bool:
    """Whether the all-gather of ``members`` over ``group`` runs zero-copy (see the module docstring):
    ``algorithm`` (``config.gloo_all_gather``) is ``"zero_copy"``, no custom all-gather ``comm``, no hpZ
    ``hpz`` (it keeps the gathered rows), K > 1 on gloo, on CPU, and every member plain ``Shard(0)``."""
    if algorithm != "zero_copy" or comm is not None or hpz is not None or group.size() == 1:
        return False
    if dist.get_backend(group) != "gloo":
        return False
    return all(p.plain and p.layout.wire_is_layout and p.local_shard().device.type == "cpu" for p in members)


def start(members: list[ShardedParam], group: dist.ProcessGroup, slot_bytes: int,
          what: str) -> collectives.GatheredRows:
    """Allocate each member's padded buffer, copy (and cast to the compute dtype) this rank's local shard
    into its own rows, and issue the in-place all-gather (``collectives.all_gather_in_place``; recorded as
    one all-gather of ``K * slot_bytes``, the group layout's figure). Wait on the returned handle before
    reading the parameters."""
    me = group.rank()
    regions, dsts, srcs = [], [], []
    for p in members:
        p.alloc()
        per_rank = p.rank_regions()
        regions.append(per_rank)
        own = per_rank[me]
        if own.numel():
            dsts.append(own.view(p.layout.local_shape(me)))
            srcs.append(p.local_shard())
    if dsts:
        with torch.no_grad():
            torch._foreach_copy_(dsts, srcs)
    return collectives.all_gather_in_place(regions, group, slot_bytes, what=what, async_op=True)
