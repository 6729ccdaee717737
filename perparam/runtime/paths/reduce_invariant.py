"""The K-invariant reduce-scatter (``perparam.invariant``): the packed ``[K, n]`` input (every gradient's
rank-r piece and the used flags in row r, as ``reduce_packed``), one all-to-all of its rows (the bytes of a
reduce-scatter; recorded as one), and each rank adding the K pieces of its rows pairwise in rank order
(``sharding.tree_sum``): rank s's piece is the sum of units ``s*U/K .. (s+1)*U/K - 1``, a node of the units'
tree, so the result is the one-rank tree sum bit for bit at every K. ``InvariantTreeAllReduce``: the
whole gradients of replicated and stage-1 parameters (and the used flags) concatenated and summed in the
same tree order on every rank (``collectives.tree_all_reduce_sum``: a reduce-scatter then an all-gather)."""

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


class InvariantTreeAllReduce:
    name = "invariant tree all-reduce"

    def issue(self, part, params, grads, used, dtype, plan) -> PendingReduce:
        flat = torch.cat([*(g.reshape(-1) for g in grads), used_flags(used, dtype, grads[0].device)])
        recv = collectives.tree_all_reduce_sum(flat, part.reduce_shard_pg,
                                               what=f"{part._what} invariant replicated [{dtype}]")
        return PendingReduce(None, None, recv, params, (), replicated=True, used=used)

    def pool_bytes(self, part, params, dtype, wire) -> int:
        return 0  # fresh buffers, outside the pool


INVARIANT_TREE = InvariantTreeReduceScatter()
INVARIANT_WHOLE = InvariantTreeAllReduce()
