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
from ..sharding.layout import reduce_scatter_offsets
from .param import ShardedParam
from .reduction import PendingReduce


def applies(params, group: dist.ProcessGroup, algorithm: str, comm, hpz) -> bool:
    """Whether the reduction of ``params`` (one reduce dtype, no ``grad_quant``) over ``group`` runs
    zero-copy (see the module docstring): ``algorithm`` (``config.gloo_reduce_scatter``) is
    ``"zero_copy"``, no custom reduce-scatter ``comm``, no hpZ ``hpz``, K > 1 on gloo, on CPU, and every
    parameter plain ``Shard(0)`` without TP."""
    if algorithm != "zero_copy" or comm is not None or hpz is not None or group.size() == 1:
        return False
    if dist.get_backend(group) != "gloo":
        return False
    return all(p.plain and p.layout.wire_is_layout and p.tp is None and p.local_shard().device.type == "cpu"
               for p in params)


def _rank_pieces(p: ShardedParam, grad: torch.Tensor) -> list[torch.Tensor]:
    """Per rank, the flat contiguous slice of ``grad`` (the whole gradient, ``Shard(0)``: dim 0 split)
    holding that rank's rows (empty for a rank without rows)."""
    lay = p.layout
    if not grad.is_contiguous():
        grad = grad.contiguous()
    flat = grad.reshape(-1)
    row = lay.numel // lay.global_shape[0] if lay.global_shape[0] else 0
    return [flat.narrow(0, start * row, length * row) for start, length in map(lay.extent, range(lay.num_shards))]


def issue(group, params: tuple[ShardedParam, ...], grads: tuple[torch.Tensor, ...], used: tuple[bool, ...],
          dtype: torch.dtype) -> PendingReduce:
    """Start the zero-copy reduce-scatter of ``params`` (``grads``: their whole gradients in ``dtype``,
    the reduce dtype; ``used``: this rank had a gradient for it) over the group's shard axis. The
    reduction's ``recv`` is the packed path's ``[sum(padded_local_numel) + len(params)]`` piece, filled
    at ``wait()``. ``group``: a ``perparam.runtime.group.ParamGroup``."""
    k = group.num_shards
    offsets, total = reduce_scatter_offsets([p.layout for p in params])
    device = grads[0].device
    flags = torch.tensor(used, dtype=dtype, device=device)
    pieces = [_rank_pieces(p, g) for p, g in zip(params, grads)] + [[flags] * k]
    recv = torch.empty(total, dtype=dtype, device=device)
    work = collectives.reduce_scatter_in_place(pieces, recv, [*offsets, total - len(params)],
                                               group.reduce_shard_pg, what=f"{group._what} [{dtype}]",
                                               pool=group.pool)
    return PendingReduce(work, None, recv, tuple(params), offsets)
