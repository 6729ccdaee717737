"""The packed reduce-scatter: every gradient's rank-r piece (padded) and the used flags packed into row r of
one ``[K, n]`` input (``pack_reduce_scatter_input``), reduce-scattered over the shard axis; through the
call's custom reduce-scatter (``ShardedModule.set_custom_reduce_scatter``) in ``CustomReduceScatter``."""

from __future__ import annotations

from ...comm import collectives
from ...sharding.layout import reduce_scatter_offsets
from .. import config
from ..reduction import PendingReduce, pack_reduce_scatter_input, used_flags


class PackedReduceScatter:
    name = "packed reduce-scatter"

    def comm(self, part):
        return None

    def issue(self, part, params, grads, used, dtype, plan) -> PendingReduce:
        comm = self.comm(part)
        flags = used_flags(used, dtype, grads[0].device)
        # [K, sum(padded_local_numel) + len(params)]
        send = pack_reduce_scatter_input(list(grads), part.num_shards, part.pool, flags)
        recv = (comm.allocate((plan.total,), dtype=dtype, device=send.device) if comm is not None
                else send.new_empty(plan.total))
        work = collectives.reduce_scatter_sum(recv, send.view(-1), part.reduce_shard_pg, async_op=True,
                                              what=f"{part._what} [{dtype}]", pool=part.pool,
                                              gloo=config.current().gloo_reduce_scatter, comm=comm)
        return PendingReduce(work, send, recv, params, plan.offsets, used=used)

    def pool_bytes(self, part, params, dtype, wire) -> int:
        """The packed ``[K, n]`` input and, for K > 2, the ``[K, n]`` pieces received (for K = 2 the peer's
        piece arrives in the output, ``perparam.comm.collectives``)."""
        k = part.num_shards
        n = reduce_scatter_offsets([p.layout for p in params])[1]
        return n * dtype.itemsize * (k if k == 2 else 2 * k)


class CustomReduceScatter(PackedReduceScatter):
    name = "custom reduce-scatter"

    def comm(self, part):
        return part.call.reduce_scatter_comm


PACKED_REDUCE_SCATTER = PackedReduceScatter()
CUSTOM_REDUCE_SCATTER = CustomReduceScatter()
