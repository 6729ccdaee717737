"""qgZ's path: the low-precision gradient reduce-scatter (ZeRO++, Wang et al., 2023): the parameters of a
group whose ``ParamPolicy.grad_quant`` is set (``perparam.sharding.grad_quant``) are reduce-scattered as
encoded rows (``QgzAllToAll``).

Per (reduce dtype, ``GradQuant``) a group issues one reduction, as it issues one per reduce dtype otherwise:

1. the gradients (in ``reduce_dtype``: after no-sync accumulation, which stays in ``reduce_dtype``) are packed
   as for a plain reduce-scatter, ``[K, n]``, row r holding every parameter's rank-r piece (int8 from fp32:
   ``encode_grads`` divides each gradient where it lies instead, packing only the padded ones);
2. each row is encoded: bf16 casts; a block quantizer (``"int8"``) quantizes each parameter's piece in
   blocks of ``block_size`` that never straddle two parameters (absmax: codes plus one fp32 scale per
   block); the *used* flags follow in fp32, exact (``GradWire``);
3. one all-to-all (``collectives.exchange_rows``) sends row r to rank r; every rank sends the same bytes,
   whatever it computed (a rank with an empty shard sends zero blocks: scale 0, decoded to exact zeros);
4. each rank decodes the K rows it received and sums them in rank order in ``reduce_dtype`` into the same
   ``[n + flags]`` piece a plain reduce-scatter leaves (``reduce_scatter_offsets``), so the HSDP all-reduce,
   ``set_requires_all_reduce(False)``, the division and the accumulation that follow are unchanged.

Error of an int8 sum, per element: at most the sum over the K ranks of half the scale of the block the
element sits in (``Int8Quantizer.error_bound``: ``amax / 254`` per rank), before the division.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...comm import collectives
from ...sharding import int8_codec
from ...sharding.grad_quant import GradQuant, GradWire, grad_wire
from ...sharding.layout import reduce_scatter_offsets
from ...sharding.quant import Int8Quantizer
from ..reduction import PendingReduce, pack_reduce_scatter_input, used_flags

if TYPE_CHECKING:
    from ..param import ShardedParam

def _section(rows: torch.Tensor, at: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """``[K, nbytes // itemsize]`` of ``dtype`` viewing bytes ``at .. at + nbytes`` of each uint8 row."""
    return rows.narrow(1, at, nbytes).view(dtype)


def _spread(packed: torch.Tensor, wire: GradWire) -> torch.Tensor:
    """``packed`` (``[K, sum(numels)]``) as fp32 ``[K, total]``, each parameter's piece starting on a block
    boundary (zeros between); the tensor itself (cast to fp32) when no piece needed padding."""
    if not wire.blocked:
        return packed if packed.dtype == torch.float32 else packed.float()
    out = packed.new_zeros(packed.shape[0], wire.total, dtype=torch.float32)
    src = dst = 0
    for n, span in zip(wire.numels, wire.spans):
        out.narrow(1, dst, n).copy_(packed.narrow(1, src, n))
        src, dst = src + n, dst + span
    return out


def encode(packed: torch.Tensor, wire: GradWire, gq: GradQuant, rows: torch.Tensor) -> torch.Tensor | None:
    """Write the codes and scales of ``packed`` (``[K, sum(numels)]``, the reduce dtype; overwritten when
    fp32 and unpadded: scratch) into ``rows`` (uint8 ``[K, wire.row_bytes]``). Returns the fp32
    ``[K, wire.total]`` tensor it quantized (``packed`` itself or a new one; its contents are garbage now:
    ``decode_sum``'s scratch), ``None`` for bf16."""
    k = packed.shape[0]
    q = gq.quantizer
    if q is None:
        _section(rows, 0, 2 * wire.total, torch.bfloat16).copy_(packed)
        return None
    x = _spread(packed, wire)
    nblocks = wire.total // gq.block_size
    blocks = x.view(k, nblocks, gq.block_size)
    scales_out = _section(rows, wire.scales_at, wire.scales_bytes, torch.float32)
    if type(q) is Int8Quantizer:  # in place, the codes straight into the rows: the same codes as encode
        scales = torch.div(int8_codec.absmax(blocks), q.qmax, out=scales_out)
        codes = _section(rows, 0, wire.total, torch.int8)
        int8_codec.encode_blocks(blocks, int8_codec.safe_divisor(scales), codes, scratch=blocks)
        return x
    codes, scales = q.encode(blocks, blocks.abs().amax(dim=2))
    stored = q.pack_codes(codes.reshape(k, wire.total))
    _section(rows, 0, stored.shape[1] * stored.element_size(), stored.dtype).copy_(stored)
    scales_out.copy_(scales)
    return x


def encode_grads(grads: tuple[torch.Tensor, ...], wire: GradWire, gq: GradQuant, rows: torch.Tensor,
                 pool) -> torch.Tensor | None:
    """``encode`` for int8, parameter by parameter from the gradients (fp32, shard dim first), without the
    plain reduce-scatter's packing pass: a gradient whose K pieces are unpadded whole blocks (e.g. a
    ``Linear(512, 2048)`` weight on 2 ranks) is quantized where it lies; any other is packed into its
    columns of the scratch first (``torch.chunk`` pieces, zero-padded to the block). The intermediate goes to
    a pooled fp32 ``[K, wire.total]`` scratch, returned (the decode's scratch; give it back to ``pool``).
    Bitwise the codes and scales of ``encode(pack_reduce_scatter_input(grads), ...)``. ``None`` (nothing
    written) unless ``gq`` is int8 and every gradient fp32."""
    q, k = gq.quantizer, rows.shape[0]
    if type(q) is not Int8Quantizer or any(g.dtype != torch.float32 for g in grads):
        return None
    bs = gq.block_size
    scratch = pool.take(k * wire.total * 4, rows.device).view(torch.float32).view(k, wire.total)
    codes = _section(rows, 0, wire.total, torch.int8)
    scales = _section(rows, wire.scales_at, wire.scales_bytes, torch.float32)
    col = 0
    for g, n, span in zip(grads, wire.numels, wire.spans):
        if span == 0:
            continue
        nblocks = span // bs
        piece = scratch.narrow(1, col, span)
        if n == span and g.is_contiguous() and g.numel() == k * n:  # its K pieces, as they lie
            blocks = g.view(k, nblocks, bs)
        else:
            if g.numel():
                piece.narrow(1, n, span - n).zero_()
                piece.narrow(1, 0, n).copy_(pack_reduce_scatter_input([g], k))
            else:
                piece.zero_()
            blocks = piece.view(k, nblocks, bs)
        s = torch.div(int8_codec.absmax(blocks), q.qmax, out=scales.narrow(1, col // bs, nblocks))
        int8_codec.encode_blocks(blocks, int8_codec.safe_divisor(s), codes.narrow(1, col, span),
                                 piece.view(k, nblocks, bs))
        col += span
    return scratch


def decode_sum(rows: torch.Tensor, wire: GradWire, gq: GradQuant, out: torch.Tensor,
               scratch: torch.Tensor | None = None) -> None:
    """Decode the K received rows (uint8 ``[K, wire.row_bytes]``, row r from rank r) and write their sum, in
    rank order, into ``out`` (``[sum(numels) + len(numels)]``, the reduce dtype): the pieces, then the
    summed used flags. ``scratch``: an fp32 ``[K, wire.total]`` tensor int8 codes are decoded into (saves
    a fresh allocation and its page faults: ``grad_quant_codec`` in ``benchmarks/README.md``)."""
    k, n = rows.shape[0], sum(wire.numels)
    q = gq.quantizer
    pieces = out.narrow(0, 0, n)
    if type(q) is Int8Quantizer and out.dtype == torch.float32:  # int8_codec: widen, multiply, add
        target = pieces if not wire.blocked else torch.empty(wire.total, dtype=out.dtype, device=out.device)
        codes = _section(rows, 0, wire.total, torch.int8)
        scales = _section(rows, wire.scales_at, wire.scales_bytes, torch.float32)
        if scratch is None:
            scratch = torch.empty(k, wire.total, dtype=torch.float32, device=out.device)
        int8_codec.decode_sum_blocks(codes, scales, scratch, target.view(-1, gq.block_size))
        _finish(rows, wire, out, target)
        return
    if q is None:
        values = _section(rows, 0, 2 * wire.total, torch.bfloat16)
    else:
        stored = q.codes_per_row(wire.total) * q.codes_dtype.itemsize
        codes = _section(rows, 0, stored, torch.uint8).view(q.codes_dtype)
        if type(q) is Int8Quantizer and scratch is not None:  # Int8Quantizer.decode, into the scratch
            values = scratch.copy_(codes)
        else:
            values = q.decode(codes, wire.total)  # a new fp32 [K, total] tensor
        scales = _section(rows, wire.scales_at, wire.scales_bytes, torch.float32)
        values.view(k, -1, gq.block_size).mul_(scales.unsqueeze(2))
    target = pieces if not wire.blocked else torch.empty(wire.total, dtype=out.dtype, device=out.device)
    if k > 1 and values.dtype == target.dtype:
        torch.add(values[0], values[1], out=target)
        first = 2
    else:  # pieces of another dtype (bf16): each added in the reduce dtype (bf16 + bf16 would round to bf16)
        target.copy_(values[0])
        first = 1
    for r in range(first, k):
        target.add_(values[r])
    _finish(rows, wire, out, target)


def _finish(rows: torch.Tensor, wire: GradWire, out: torch.Tensor, target: torch.Tensor) -> None:
    """``decode_sum``'s end: the summed pieces ``target`` (``[wire.total]``, blocked layout; ``out``'s own
    first ``sum(numels)`` elements when not blocked) packed into ``out``, then the summed used flags."""
    n = sum(wire.numels)
    if wire.blocked:
        pieces = out.narrow(0, 0, n)
        src = dst = 0
        for numel, span in zip(wire.numels, wire.spans):
            pieces.narrow(0, dst, numel).copy_(target.narrow(0, src, numel))
            src, dst = src + span, dst + numel
    flags = _section(rows, wire.flags_at, wire.flags_bytes, torch.float32)
    out.narrow(0, n, len(wire.numels)).copy_(flags.sum(dim=0))


class _DecodeAfterExchange:
    """A work handle: once the all-to-all has delivered the K rows, decode and sum them into ``out`` and
    give the receive buffer (unless ``rows`` is the send buffer: K = 1) and the scratch back to ``pool``."""

    def __init__(self, work, rows: torch.Tensor, wire: GradWire, gq: GradQuant, out: torch.Tensor, pool,
                 scratch: torch.Tensor | None, give_rows: bool) -> None:
        self.work, self.rows, self.wire, self.gq, self.out, self.pool = work, rows, wire, gq, out, pool
        self.scratch, self.give_rows = scratch, give_rows

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()

    def wait(self) -> bool:
        if self.rows is None:
            return True
        if self.work is not None:
            self.work.wait()
            self.work = None
        decode_sum(self.rows, self.wire, self.gq, self.out, self.scratch)
        if self.give_rows:
            self.pool.give_back(self.rows)
        if self.scratch is not None:
            self.pool.give_back(self.scratch)
        self.rows = self.scratch = None
        return True


class QgzAllToAll:
    name = "qgZ all-to-all"

    def issue(self, part, params: tuple[ShardedParam, ...], grads: tuple[torch.Tensor, ...],
              used: tuple[bool, ...], dtype: torch.dtype, plan) -> PendingReduce:
        """Start the low-precision reduce-scatter of ``params`` (their gradients ``grads`` in ``dtype``, the
        reduce dtype, shard dim first; ``used``: this rank had a gradient for it) over the part's shard axis
        in ``plan.wire``'s format; the reduction's ``recv`` is the plain reduce-scatter's ``[n + flags]``
        piece, filled at ``wait()``. Raises ``RuntimeError`` when the call has a custom reduce-scatter."""
        if part.call.reduce_scatter_comm is not None:  # set_custom_reduce_scatter checks it too
            raise RuntimeError(f"perparam: {part._what} has a custom reduce-scatter and grad_quant "
                               f"parameters ({', '.join(p.path for p in params)}); drop one of the two")
        gq = plan.wire
        k, pool = part.num_shards, part.pool
        layouts = [p.layout for p in params]
        wire = grad_wire([lay.padded_local_numel for lay in layouts], gq)
        device = grads[0].device
        rows = pool.take(k * wire.row_bytes, device).view(k, wire.row_bytes)
        scratch = encode_grads(grads, wire, gq, rows, pool)
        if scratch is None:  # packed as for a plain reduce-scatter, then encoded
            packed = pack_reduce_scatter_input(list(grads), k, pool)  # [K, n] in the reduce dtype
            scratch = encode(packed, wire, gq, rows)
            if scratch is not packed:  # else kept as the decode's scratch, given back after it
                pool.give_back(packed)
        _section(rows, wire.flags_at, wire.flags_bytes, torch.float32).copy_(
            used_flags(used, torch.float32, device))
        offsets, total = reduce_scatter_offsets(layouts)
        recv = torch.empty(total, dtype=dtype, device=device)
        codes = torch.bfloat16 if gq.quantizer is None else gq.quantizer.codes_dtype
        work, received = collectives.exchange_rows(rows, part.reduce_shard_pg, pool,
                                                   what=f"{part._what} [{dtype} as {gq}]", dtype=codes)
        # K = 1: ``received`` is ``rows`` itself, given back with the reduction's ``send``
        handle = _DecodeAfterExchange(work, received, wire, gq, recv, pool, scratch, received is not rows)
        return PendingReduce(handle, rows, recv, tuple(params), offsets, kind=gq, used=tuple(used))

    def pool_bytes(self, part, params, dtype, wire) -> int:
        """An upper bound: the encoded send rows and the rows received (``[K, row_bytes]`` each), the fp32
        ``[K, total]`` scratch and the packed ``[K, n]`` input the encoding may need first."""
        k = part.num_shards
        gw = grad_wire([p.layout.padded_local_numel for p in params], wire)
        packed = k * sum(gw.numels) * dtype.itemsize
        return 2 * k * gw.row_bytes + k * gw.total * 4 + packed


QGZ = QgzAllToAll()
