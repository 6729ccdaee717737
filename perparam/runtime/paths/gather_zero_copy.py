"""The zero-copy all-gather: a group's unsharded parameters receive the other ranks' pieces straight into
their padded buffers, so nothing is copied out of a gathered row buffer afterwards.

With ``perparam.configure(gloo_all_gather="zero_copy")`` on gloo on CPU, an all-gather whose members are all
plain ``Shard(0)`` parameters (``ShardedParam.plain`` and ``layout.wire_is_layout``: the K pieces are the
buffer's rows, in rank order) runs as per-parameter point-to-point sends and receives
(``perparam.comm.collectives.all_gather_in_place``): each rank copies (and casts) its local shard into its
own rows of the buffer, sends those rows to every peer and receives each peer's rows in place. Bytes moved:
the local shards, once to each peer; copies: the copy-in only (the row path also copies every gathered
row out). Every other all-gather (quantized pieces, ``Shard(d > 0)``, a custom all-gather, hpZ, which keeps
the gathered rows, other backends, K = 1) takes the packed row path (``gather_rows``); the rule is
``choose.GATHER_RULES``' row. Why per-parameter transfers and not one collective: in one collective each
rank's contribution lands in one contiguous region, so only a group of one parameter could get contiguous
unsharded parameters from it; the measurements are in ``benchmarks/README.md``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...comm import collectives
from .gather import Gather
from .gather_rows import PACKED


def eligible(members, group: dist.ProcessGroup) -> bool:
    """What never changes for one set of members (``ShardedParam``s): K > 1 on gloo and every member plain
    ``Shard(0)`` (``ShardedParam.plain`` and ``layout.wire_is_layout``). Asked once per member set
    (``choose.gather_set_facts``, kept in the part's ``_gather_plan``)."""
    if group.size() == 1 or dist.get_backend(group) != "gloo":
        return False
    return all(p.plain and p.layout.wire_is_layout for p in members)


class ZeroCopyGather:
    name = "zero-copy"
    reads_shards = True

    def start(self, part, members, layout) -> Gather:
        """Allocate each member's padded buffer, copy (and cast to the compute dtype) this rank's local shard
        into its own rows, and issue the in-place all-gather (``collectives.all_gather_in_place``; recorded
        as one all-gather of ``K * slot_bytes``, the group layout's figure). A local shard not on the CPU
        (``to_empty``, ``.to``, a ``.data`` swap: read at each unshard) sends the set the packed rows' way
        (the members are plain; buffers allocated so far are kept)."""
        regions, dsts, srcs = [], [], []
        for p in members:
            src = p.local_shard()
            if src.device.type != "cpu":
                return PACKED.start(part, members, layout)
            p.alloc()
            per_rank, own = p.rank_regions()
            regions.append(per_rank)
            if own is not None and own.data_ptr() != src.data_ptr():  # (a shard viewing its rows: there)
                dsts.append(own)
                srcs.append(src)
        if dsts:
            with torch.no_grad():
                torch._foreach_copy_(dsts, srcs)
        rows = collectives.all_gather_in_place(regions, part.shard_pg, layout.slot_bytes, what=part._what,
                                               async_op=True)
        return Gather(self, None, rows, members, layout)

    def finish(self, part, gather: Gather) -> None:
        gather.rows.wait()  # the pieces arrived in the buffers

    def pool_bytes(self, part, members, layout) -> int:
        if all(p.local_shard().device.type == "cpu" for p in members):
            return 0  # straight into the parameters' buffers
        return PACKED.pool_bytes(part, members, layout)


ZERO_COPY = ZeroCopyGather()
