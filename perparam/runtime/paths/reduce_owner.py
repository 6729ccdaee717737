"""The reduction to owners (``perparam.configure(owner_grad="owner")``): the gradients of
``ParamPolicy(update="owner")`` parameters whose owner is planned (``ShardedParam.owner_rank``, set by
``perparam.runtime.owner_step.plan``) summed straight onto their owner, whole there and nowhere else.

One all-to-all over the shard axis: each rank sends every parameter's whole gradient (wire order) to its
owner, and to every rank two flags per parameter, that its ``.grad`` was zeroed in place
(``owner_grads.zeroed_flags``) and the used flags; each rank sums what it received in rank order
(``collectives.reduce_to_owners``). ``recv``: the whole summed gradients of the parameters this rank owns, in
order, then the summed zeroed flags (``[n]``) and the summed used flags (``[n]``, last, as every path's), so
the tail of the reduction (the HSDP all-reduce over the replicate axis, whose ranks own the same parameters)
is the same as for any path; what differs after it is this path's ``OwnerTail`` (``reduction.ReduceTail``):
two rows of flags, each owned whole gradient's piece (``partial``'s held sums), and the accumulation
(``owner_grads.accumulate``). Which parameters go this way is ``owner_apart`` (``choose.apart``): the common
tail (``part``, ``partial``, ``reduction``) names no owner. On the wire, summed over the ranks:
``(K-1) m n`` elements per ``m x n`` matrix (each other rank's whole gradient), the reduce-scatter's bytes,
and the rows never travel at the step (``owner_exchange``): ``2 (K-1)/K m n`` there instead of
``3 (K-1)/K m n``."""

from __future__ import annotations

import torch

from ...comm import collectives
from .. import config, owner_grads
from ..reduction import PendingReduce, ReduceTail, used_flags


def owner_apart(part):
    """Under ``configure(owner_grad="owner")`` on a part of K > 1 shards not reducing in tree order
    (``perparam.invariant``): the rule taking a parameter into this path's reduction (a planned owner, a
    gradient reduce-scattered otherwise: not whole, no ``grad_quant``); else ``None``."""
    if config.current().owner_grad != "owner" or part.num_shards == 1 or part.call.invariant:
        return None
    return _to_owner


def _to_owner(p, whole: bool, wire) -> bool:
    return not whole and wire is None and p.owner_rank is not None


class OwnerTail(ReduceTail):
    """``recv`` of a reduction to the owners: the whole gradients this rank owns, in order, then the zeroed
    flags, then the used flags."""

    flag_rows = 2

    def pieces(self, item) -> list[tuple[int, int]]:
        """The whole gradients of the parameters this rank owns one after another, an empty piece for each
        other one."""
        out, cursor = [], 0
        for p in item.params:
            n = p.layout.numel if p.owner_rank == p.shard_rank else 0
            out.append((cursor, n))
            cursor += n
        return out

    def accumulate(self, part, item, grads: torch.Tensor, flags: list[float], divisor) -> bool:
        """Divide the owned whole gradients and add each into its owner's ``.grad``
        (``owner_grads.accumulate``; the other ranks' ``.grad`` NaN rows), queue the post-accumulate-grad
        hooks of the used ones (``divisor`` ``None``: no division pass)."""
        recv, n = item.recv, len(item.params)
        if divisor is not None:
            grads.div_(divisor)
        me, offset = part.reduce_shard_pg.rank(), 0
        zeroed = recv.narrow(0, recv.numel() - 2 * n, n)  # summed over the ranks: the same on every rank
        for i, (p, flag) in enumerate(zip(item.params, flags)):
            whole = None
            if p.owner_rank == me:
                whole, offset = grads.narrow(0, offset, p.layout.numel), offset + p.layout.numel
            # a .grad zeroed in place and unused by every rank now is replaced by the zeros reduced
            # (``.grad`` is None, or not, on every rank alike)
            if flag > 0 or p.sharded.grad is not None:
                owner_grads.accumulate(p, whole, zeroed[i])
            if flag > 0:
                part.ctx.grad_hooks_due.append((item.seq, i, p))
        return True


OWNER_TAIL = OwnerTail()


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
        return PendingReduce(work, None, recv, params, (), used=used, tail=OWNER_TAIL)

    def pool_bytes(self, part, params, dtype, wire) -> int:
        return 0  # fresh buffers, outside the pool


OWNER_REDUCE = ReduceToOwner()
