"""A gradient reduction in flight (``PendingReduce``) and the reduce-scatter's packed input: the state
``ParamGroup.reduce_grads`` hands the iteration context's queue (``perparam.runtime.context``), which advances it
without ever waiting in backward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..comm.buffers import BufferPool
from ..sharding.layout import ceil_div

if TYPE_CHECKING:
    from .param import ShardedParam


@dataclass
class PendingReduce:
    """A reduction in flight: its work handle, buffers (kept alive until it finishes) and params. A
    reduce-scatter (``send``: its packed input, ``recv``: this rank's piece), or with ``replicated`` an
    all-reduce of replicated parameters' gradients (``send`` None, ``recv`` the flat gradients + flags)."""

    work: object
    send: torch.Tensor | None
    recv: torch.Tensor
    params: tuple[ShardedParam, ...]
    offsets: tuple[int, ...]
    replicated: bool = False
    stage: int = 0  # 0: reduce-scatter (or shard-axis all-reduce) in flight, 1: HSDP all-reduce in flight, 2: done
    discard: bool = False
    seq: int = 0  # issue number in the iteration context: orders the post-accumulate-grad hooks
    part: object = None  # the ParamGroup of the mesh it runs on (a companion, for a parameter's own mesh)
    kind: object = None  # the wire format of a low-precision reduce-scatter (perparam.runtime.grad_quant)


def pack_reduce_scatter_input(grads: list[torch.Tensor], num_shards: int, pool: BufferPool | None = None,
                              flags: torch.Tensor | None = None) -> torch.Tensor:
    """``[K, sum(padded_local_numel) (+ len(flags))]``: row r holds every gradient's rank-r ``torch.chunk``
    piece, padded to the chunk size, in order (``torch._chunk_cat``; empty gradients contribute nothing),
    then ``flags`` (``[n]``) repeated in every row. The buffer comes from ``pool.take`` when a pool is
    given: give it back once the reduce-scatter has finished."""
    tensors = [g for g in grads if g.numel()]
    if flags is not None:
        tensors.append(flags.view(1, -1).expand(num_shards, -1).contiguous())
    if not tensors:
        return grads[0].new_empty(num_shards, 0)
    cols = sum(ceil_div(t.shape[0], num_shards) * (t.numel() // t.shape[0]) for t in tensors)
    dtype = tensors[0].dtype
    nbytes = num_shards * cols * dtype.itemsize
    raw = pool.take(nbytes, tensors[0].device) if pool is not None else torch.empty(nbytes, dtype=torch.uint8,
                                                                                     device=tensors[0].device)
    out = raw.view(dtype).view(num_shards, cols)
    return torch._chunk_cat(tensors, dim=0, num_chunks=num_shards, out=out)
