"""A gradient reduction in flight (``PendingReduce``) and the reduce-scatter's packed input: the state
``ParamGroup.reduce_grads`` hands the iteration context's queue (``perparam.runtime.context``), which advances
it without ever waiting in backward."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from ..comm.buffers import BufferPool
from ..sharding.layout import ceil_div, reduce_scatter_offsets

if TYPE_CHECKING:
    from .param import ShardedParam


class ReduceTail:
    """What a path's output means to the common tail of a reduction (``MeshPart._advance``/``_accumulate``,
    ``partial``): the default is every path's but the one that replaces it (a path builds its
    ``PendingReduce`` with a tail of its own, ``paths.reduce_owner``), so the tail asks its item and never
    which path ran. ``flag_rows``: ``[len(params)]`` rows of flags ending ``recv`` (the used flags last);
    ``pieces``: each parameter's ``(offset, numel)`` in ``recv``; ``accumulate``: the division and the
    accumulation into ``.grad`` when the path does them itself (``True``), else ``False``."""

    flag_rows = 1

    def pieces(self, item: PendingReduce) -> list[tuple[int, int]]:
        """The padded local shards at the reduce-scatter's ``offsets``, or (``replicated``: an all-reduce)
        the whole gradients one after another."""
        if not item.replicated:
            return [(o, p.layout.padded_local_numel) for o, p in zip(item.offsets, item.params)]
        out, cursor = [], 0
        for p in item.params:
            out.append((cursor, p.layout.numel))
            cursor += p.layout.numel
        return out

    def accumulate(self, part, item: PendingReduce, grads: torch.Tensor, flags: list[float], divisor) -> bool:
        return False


#: the tail of every path that keeps the default (``ReduceTail``)
ROWS_TAIL = ReduceTail()


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
    # 0: reduce-scatter (or shard-axis all-reduce) in flight, 1: HSDP all-reduce in flight, 2: done
    stage: int = 0
    discard: bool = False
    seq: int = 0  # issue number in the iteration context: orders the post-accumulate-grad hooks
    part: object = None  # the MeshPart of the mesh it runs on (set by ``MeshPart._reduce``)
    kind: object = None  # the wire format of a low-precision reduction (``ReducePlan.wire``), or None
    used: tuple[bool, ...] | None = None  # this rank had a gradient for each of ``params`` (None: unknown)
    #: what ``recv`` means to the common tail: ``ROWS_TAIL``, or the issuing path's own (``ReduceTail``)
    tail: ReduceTail = ROWS_TAIL
    #: what the gradients were divided by before they went on the wire (``MeshPart.predivisor``: fp16)
    predivided: float = 1

    @property
    def flag_rows(self) -> int:
        """How many ``[len(params)]`` rows of flags end ``recv`` (the used flags last): the tail's."""
        return self.tail.flag_rows

    def summed_flags(self) -> list[float]:
        """Per parameter, the number of ranks that had a gradient for it (> 0: some rank did), from the
        flags at the end of ``recv``, which must have been reduced. Where this rank had a gradient for
        every parameter each sum is at least its own 1, so nothing is read back from the device (a host
        sync on CUDA); the flags are read only when this rank lacked a gradient a peer may have had."""
        n = len(self.params)
        if self.used is not None and all(self.used):
            return [1.0] * n
        return self.recv.narrow(0, self.recv.numel() - n, n).tolist()


#: (used flags, dtype, device) -> the flags as a tensor there: a step's flags are uploaded once, not per
#: reduction (``torch.tensor(host list, device=cuda)`` is a synchronous copy)
_FLAGS: dict[tuple, torch.Tensor] = {}
_FLAGS_MAX = 256  # distinct patterns kept; past that the cache starts again


def used_flags(used: tuple[bool, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The used flags of a reduction (1 where this rank had a gradient, else 0) as a ``[len(used)]`` tensor
    of ``dtype`` on ``device``, made once per distinct ``used`` and kept: read it, never write it (every
    reduction with the same pattern shares it; it is never freed, so a collective may read it on any
    stream)."""
    key = (tuple(bool(u) for u in used), dtype, torch.device(device))
    flags = _FLAGS.get(key)
    if flags is None:
        if len(_FLAGS) >= _FLAGS_MAX:
            _FLAGS.clear()
        flags = _FLAGS[key] = torch.tensor(key[0], dtype=dtype, device=device)
    return flags


class ReducePlan(NamedTuple):
    """What never changes for the reduction of one set of parameters (``MeshPart._reduce_plan``): pure
    functions of their layouts and shard ranks, fixed at ``fully_shard``, so built once per parameter set
    (the set itself may change between steps: a parameter frozen or unfrozen makes another set)."""

    offsets: tuple[int, ...]  # element offset of each parameter's piece in the reduction's output
    total: int  # the output's elements: padded pieces, then one used flag per parameter
    #: per parameter ``(offset, numel, shape)``: this rank's rows of its summed gradient in the output, in
    #: wire order (split dim first; ``shape[0]``: the rows this rank holds, 0 for an empty shard)
    views: tuple[tuple[int, int, tuple[int, ...]], ...]
    #: the facts of the set the paths' rules read (``paths.choose.reduce_set_facts``: ``ReduceFacts`` fields)
    facts: dict
    wire: object = None  # the ``GradQuant`` of a low-precision reduction (qgZ), or None
    #: the path chosen for this set (``paths.choose.reduce_path``), per ``ReduceFacts`` read at a reduction
    #: (with the rules' version it was chosen at)
    paths: dict | None = None
    #: what a path works out once for this set, by the path's name (its own business)
    path_data: dict | None = None

    def targets(self, recv: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``recv`` (the reduction's output, ``[total]``): each parameter's rows on this rank, in
        wire order (``ShardLayout.wire_shape`` narrowed to the rank's extent)."""
        return [recv.narrow(0, offset, numel).view(shape) for offset, numel, shape in self.views]


def reduce_plan(params: tuple[ShardedParam, ...], facts: dict, wire=None) -> ReducePlan:
    """The ``ReducePlan`` of ``params`` (in the reduction's order); ``facts``: what the paths' rules read
    of the set (``paths.choose.reduce_set_facts``); ``wire``: qgZ's format."""
    offsets, total = reduce_scatter_offsets([p.layout for p in params])
    views = []
    for p, offset in zip(params, offsets):
        lay = p.layout
        shape = (lay.extent(p.shard_rank)[1], *lay.wire_shape[1:])
        views.append((offset, math.prod(shape), shape))
    return ReducePlan(offsets, total, tuple(views), facts, wire, {}, {})


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
