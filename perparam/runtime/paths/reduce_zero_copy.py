"""The zero-copy reduce-scatter: a group's ``Shard(0)`` gradients are sent to their owners straight from the
unsharded gradients, without packing them into a ``[K, n]`` send buffer first.

With ``perparam.configure(gloo_reduce_scatter="zero_copy")`` on gloo on CPU, a reduction (one per mesh and
reduce dtype) whose parameters are all plain ``Shard(0)`` parameters (``ShardedParam.plain`` and
``layout.wire_is_layout``, no TP) and sent in the reduce dtype (no ``grad_quant``) runs as per-parameter
point-to-point sends and receives (``perparam.comm.collectives.reduce_scatter_in_place``): rank r's rows of
a ``Shard(0)`` gradient are one contiguous slice, sent as they are; the peers' slices of this rank's rows
arrive in the reduction's output (K = 2) or in a pooled ``[K, n]`` buffer (K > 2) and are summed in rank
order with this rank's own slice. The output is the packed path's, element for element (padding zeros,
then the *used* flags), so the common tail that follows is unchanged. Copies saved: the packing
(``pack_reduce_scatter_input``: every gradient read and written once more). Every other reduction (a
custom reduce-scatter, ``grad_quant``, ``Shard(d > 0)``, TP, hpZ, other backends, K = 1) is packed; the
rule is ``choose.REDUCE_RULES``' row.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...comm import collectives
from ...sharding.layout import reduce_scatter_offsets
from ..reduction import PendingReduce, ReducePlan, used_flags


def eligible(params, group: dist.ProcessGroup) -> bool:
    """What never changes for one set of parameters (``ShardedParam``s): K > 1 on gloo and every parameter
    plain ``Shard(0)`` without TP. Asked once per parameter set (``choose.reduce_set_facts``, kept in its
    ``ReducePlan``)."""
    if group.size() == 1 or dist.get_backend(group) != "gloo":
        return False
    return all(p.plain and p.layout.wire_is_layout and p.tp is None for p in params)


def _rank_pieces(grad: torch.Tensor, numels: tuple[int, ...]) -> list[torch.Tensor]:
    """Per rank, the flat contiguous slice of ``grad`` (the whole gradient, ``Shard(0)``: dim 0 split)
    holding that rank's rows (empty for a rank without rows); ``numels``: their sizes, which add up to the
    gradient's, in rank order."""
    if not grad.is_contiguous():
        grad = grad.contiguous()
    return grad.reshape(-1).split_with_sizes(numels)


class ZeroCopyReduceScatter:
    name = "zero-copy reduce-scatter"

    def _fixed(self, params, plan: ReducePlan) -> tuple[tuple, tuple]:
        """What never changes for ``plan``'s set, worked out at its first zero-copy reduction and kept in the
        plan (``ReducePlan.path_data``): per parameter the elements of each rank's rows of the whole
        gradient, and the output's runs of padding ``(start, length)`` (``collectives.zero_gaps``)."""
        fixed = plan.path_data.get(self.name)
        if fixed is None:
            rank_numels = []
            for p in params:
                lay = p.layout
                row = lay.numel // lay.global_shape[0] if lay.global_shape[0] else 0
                rank_numels.append(tuple(lay.extent(r)[1] * row for r in range(lay.num_shards)))
            own = [numel for _, numel, _ in plan.views] + [len(params)]
            gaps = collectives.zero_gaps([*plan.offsets, plan.total - len(params)], own, plan.total)
            fixed = plan.path_data[self.name] = (tuple(rank_numels), tuple(gaps))
        return fixed

    def issue(self, part, params, grads, used, dtype, plan) -> PendingReduce:
        """Start the zero-copy reduce-scatter of ``params`` (``grads``: their whole gradients in ``dtype``,
        the reduce dtype; ``used``: this rank had a gradient for it) over the part's shard axis. The
        reduction's ``recv`` is the packed path's ``[sum(padded_local_numel) + len(params)]`` piece, filled
        at ``wait()``."""
        k = part.num_shards
        device = grads[0].device
        rank_numels, gaps = self._fixed(params, plan)
        flags = used_flags(used, dtype, device)
        pieces = [_rank_pieces(g, numels) for g, numels in zip(grads, rank_numels)] + [[flags] * k]
        recv = torch.empty(plan.total, dtype=dtype, device=device)
        work = collectives.reduce_scatter_in_place(pieces, recv, [*plan.offsets, plan.total - len(params)],
                                                   part.reduce_shard_pg, what=f"{part._what} [{dtype}]",
                                                   pool=part.pool, gaps=gaps)
        return PendingReduce(work, None, recv, tuple(params), plan.offsets, used=tuple(used))

    def pool_bytes(self, part, params, dtype, wire) -> int:
        """No packed input; for K > 2 one ``[K, n]`` staging buffer of the peers' pieces."""
        k = part.num_shards
        return 0 if k == 2 else reduce_scatter_offsets([p.layout for p in params])[1] * dtype.itemsize * k


ZERO_COPY_REDUCE_SCATTER = ZeroCopyReduceScatter()
