"""The reduction to owners (``perparam.configure(owner_grad="owner")``): the gradients of
``ParamPolicy(update="owner")`` parameters whose owner is planned (``ShardedParam.owner_rank``, set by
``perparam.runtime.owner_step.plan``) summed straight onto their owner, whole there and nowhere else.

One all-to-all over the shard axis: each rank sends every parameter's whole gradient (wire order) to its
owner, and to every rank two flags per parameter, that its ``.grad`` was zeroed in place
(``owner_grads.zeroed_flags``) and the used flags; each rank sums what it received in rank order
(``collectives.reduce_to_owners``). ``recv``: the whole summed gradients of the parameters this rank owns,
in order, then the summed zeroed flags (``[n]``) and the summed used flags (``[n]``, last, as every path's), so the tail of the reduction (the HSDP all-reduce over the
replicate axis, whose ranks own the same parameters) is the same as for any path; its accumulation is
``owner_grads.accumulate`` (``MeshPart._accumulate``). On the wire, summed over the ranks: ``(K-1) m n``
elements per ``m x n`` matrix (each other rank's whole gradient), the reduce-scatter's bytes, and the rows
never travel at the step (``owner_exchange``): ``2 (K-1)/K m n`` there instead of ``3 (K-1)/K m n``."""

from __future__ import annotations

import torch

from ...comm import collectives
from .. import owner_grads
from ..reduction import PendingReduce, used_flags


class ReduceToOwner:
    name = "reduce to owner"

    def issue(self, part, params, grads, used, dtype, plan) -> PendingReduce:
        pg = part.reduce_shard_pg
        k, me = pg.size(), pg.rank()
        flags = used_flags(used, dtype, grads[0].device)
        zeroed = owner_grads.zeroed_flags(params, dtype, grads[0].device)
        if zeroed is None:  # no .grad to accumulate onto: zeros, like the unused flags of a cached pattern
            zeroed = used_flags((False,) * len(params), dtype, grads[0].device)
        n = 2 * len(params)
        pieces, splits = [], [0] * k
        for dest in range(k):
            for p, g in zip(params, grads):
                if p.owner_rank == dest:
                    pieces.append(g.reshape(-1))
                    splits[dest] += g.numel()
            pieces += [zeroed, flags]
            splits[dest] += n
        send = torch.cat(pieces)
        recv = send.new_empty(sum(g.numel() for p, g in zip(params, grads) if p.owner_rank == me) + n)
        work = collectives.reduce_to_owners(send, splits, recv, pg, what=f"{part._what} to owners [{dtype}]")
        return PendingReduce(work, None, recv, params, (), used=used, to_owner=True)

    def pool_bytes(self, part, params, dtype, wire) -> int:
        return 0  # fresh buffers, outside the pool


OWNER_REDUCE = ReduceToOwner()
