"""The K-invariant reduce-scatter (``perparam.invariant``): the packed ``[K, n]`` input (every gradient's
rank-r piece and the used flags in row r, as ``reduce_packed``), one all-to-all of its rows (the bytes of a
reduce-scatter; recorded as one), and each rank adding the K pieces of its rows pairwise in rank order
(``sharding.tree_sum``): rank s's piece is the sum of units ``s*U/K .. (s+1)*U/K - 1``, a node of the units'
tree, so the result is the one-rank tree sum bit for bit at every K."""

from __future__ import annotations

import torch

from ...comm import collectives
from ...sharding.tree_sum import tree_sum
from ..reduction import PendingReduce, pack_reduce_scatter_input, used_flags


class InvariantTreeReduceScatter:
    name = "invariant tree reduce-scatter"

    def issue(self, part, params, grads, used, dtype, plan) -> PendingReduce:
        flags = used_flags(used, dtype, grads[0].device)
        send = pack_reduce_scatter_input(list(grads), part.num_shards, None, flags)  # [K, n]
        k, n = send.shape
        work, rows = collectives.exchange_rows(send.view(torch.uint8), part.reduce_shard_pg,
                                               what=f"{part._what} invariant [{dtype}]", dtype=dtype)
        if work is not None:
            work.wait()
        rows = rows.view(dtype).view(k, n)
        recv = tree_sum([rows[s] for s in range(k)]) if k > 1 else rows[0].clone()
        return PendingReduce(None, None, recv, params, plan.offsets, used=used)

    def pool_bytes(self, part, params, dtype, wire) -> int:
        return 0  # fresh buffers, outside the pool


INVARIANT_TREE = InvariantTreeReduceScatter()
