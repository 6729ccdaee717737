"""The whole-gradient all-reduce: replicated parameters' and stage-1 parameters' gradients (and the used
flags) concatenated and all-reduced over the shard axis; the replicate axis follows from the queue."""

from __future__ import annotations

import torch

from ...comm import collectives
from ..reduction import PendingReduce, used_flags


class WholeAllReduce:
    name = "whole-gradient all-reduce"

    def issue(self, part, params, grads, used, dtype, plan) -> PendingReduce:
        flat = torch.cat([*(g.reshape(-1) for g in grads), used_flags(used, dtype, grads[0].device)])
        # asynchronous like the reduce-scatters, and queued with them: a rank must never wait for a
        # reduction in backward, and the all-reduce over the replicate axis that follows is issued
        # from the queue in issue order, as the sharded reductions' are (same order on every rank)
        work = collectives.all_reduce_sum(flat, part.reduce_shard_pg, async_op=True,
                                          what=f"{part._what} replicated [{dtype}]")
        return PendingReduce(work, None, flat, params, (), replicated=True, used=used)

    def pool_bytes(self, part, params, dtype, wire) -> int:
        return 0  # a fresh flat tensor, outside the pool


WHOLE = WholeAllReduce()
