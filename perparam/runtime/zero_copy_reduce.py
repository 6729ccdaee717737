"""The zero-copy reduce-scatter: a group's ``Shard(0)`` gradients are sent to their owners straight from the
unsharded gradients, without packing them into a ``[K, n]`` send buffer first.

With ``perparam.configure(gloo_reduce_scatter="zero_copy")`` on gloo on CPU, a reduction (one per mesh and
reduce dtype) whose parameters are all plain ``Shard(0)`` parameters (``ShardedParam.plain`` and
``layout.wire_is_layout``, no TP) and sent in the reduce dtype (no ``grad_quant``) runs as per-parameter
point-to-point sends and receives (``perparam.comm.collectives.reduce_scatter_in_place``): rank r's rows of
a ``Shard(0)`` gradient are one contiguous slice, sent as they are; the peers' slices of this rank's rows
arrive in the reduction's output (K = 2) or in a pooled ``[K, n]`` buffer (K > 2) and are summed in rank
order with this rank's own slice. The output is the packed path's, element for element (padding zeros,
then the *used* flags), so the HSDP all-reduce, ``set_requires_all_reduce(False)``, the all-reduce hook,
the division and the accumulation that follow are unchanged. Copies saved: the packing
(``pack_reduce_scatter_input``: every gradient read and written once more). Every other reduction (a
custom reduce-scatter, ``grad_quant``, ``Shard(d > 0)``, TP, hpZ, other backends, K = 1) is packed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import collectives
from .param import ShardedParam
from .reduction import PendingReduce, ReducePlan, used_flags


def wanted(algorithm: str, comm, hpz) -> bool:
    """The runtime's settings allow a zero-copy reduce-scatter: ``algorithm`` (``config.gloo_reduce_scatter``)
    is ``"zero_copy"``, no custom reduce-scatter ``comm``, no hpZ ``hpz``. Read at every reduction
    (``perparam.configure`` applies from the next collective on)."""
    return algorithm == "zero_copy" and comm is None and hpz is None


def eligible(params, group: dist.ProcessGroup) -> bool:
    """What never changes for one set of parameters: K > 1 on gloo and every parameter plain ``Shard(0)``
    without TP. ``MeshPart`` asks once per parameter set and keeps the answer in its ``ReducePlan``."""
    if group.size() == 1 or dist.get_backend(group) != "gloo":
        return False
    return all(p.plain and p.layout.wire_is_layout and p.tp is None for p in params)


def on_cpu(tensors) -> bool:
    """Every tensor (the gradients a reduction sends) is on the CPU: the one condition read at each
    reduction (``to_empty``, ``.to`` or a ``.data`` swap may move a shard, and its gradients with it)."""
    return all(t.is_cpu for t in tensors)


def applies(params, group: dist.ProcessGroup, algorithm: str, comm, hpz) -> bool:
    """Whether the reduction of ``params`` (one reduce dtype, no ``grad_quant``) over ``group`` runs
    zero-copy (see the module docstring): ``wanted``, ``eligible`` and every local shard on the CPU."""
    return (wanted(algorithm, comm, hpz) and eligible(params, group)
            and on_cpu([p.local_shard() for p in params]))


def _rank_pieces(grad: torch.Tensor, numels: tuple[int, ...]) -> list[torch.Tensor]:
    """Per rank, the flat contiguous slice of ``grad`` (the whole gradient, ``Shard(0)``: dim 0 split)
    holding that rank's rows (empty for a rank without rows); ``numels``: their sizes
    (``ReducePlan.rank_numels``), which add up to the gradient's, in rank order."""
    if not grad.is_contiguous():
        grad = grad.contiguous()
    return grad.reshape(-1).split_with_sizes(numels)


def issue(group, params: tuple[ShardedParam, ...], grads: tuple[torch.Tensor, ...], used: tuple[bool, ...],
          dtype: torch.dtype, plan: ReducePlan) -> PendingReduce:
    """Start the zero-copy reduce-scatter of ``params`` (``grads``: their whole gradients in ``dtype``,
    the reduce dtype; ``used``: this rank had a gradient for it) over the group's shard axis. The
    reduction's ``recv`` is the packed path's ``[sum(padded_local_numel) + len(params)]`` piece, filled
    at ``wait()``. ``group``: a ``perparam.runtime.group.ParamGroup``; ``plan``: its ``ReducePlan`` of
    ``params`` (zero-copy)."""
    k = group.num_shards
    device = grads[0].device
    flags = used_flags(used, dtype, device)
    pieces = [_rank_pieces(g, numels) for g, numels in zip(grads, plan.rank_numels)] + [[flags] * k]
    recv = torch.empty(plan.total, dtype=dtype, device=device)
    work = collectives.reduce_scatter_in_place(pieces, recv, [*plan.offsets, plan.total - len(params)],
                                               group.reduce_shard_pg, what=f"{group._what} [{dtype}]",
                                               pool=group.pool, gaps=plan.gaps)
    return PendingReduce(work, None, recv, tuple(params), plan.offsets, used=tuple(used))
