"""The all-gather paths over packed rows: every rank's local shards packed into one uint8 row
(``GroupLayout``: one slot per member, any mix of dtypes), the K rows all-gathered, then copied out rank by
rank into the padded unsharded buffers.

``PackedRows``: plain members (the local shard's bytes are the piece). ``QuantizedPieces``: some member's
pieces are quantized (packed with ``ShardedParam.pack``, copied out into scratch pieces and dequantized
with ``unpack``). ``CustomGather``: the same rows through ``ShardedModule.set_custom_all_gather``'s
collective. hpZ's secondary all-gather copies its rows out as these do (``gather_hpz``).
"""

from __future__ import annotations

import torch

from ...comm import collectives
from .. import config
from .gather import Gather


class PackedRows:
    """Plain members' local shards copied (and cast) into one send row, all-gathered over the shard axis."""

    name = "packed rows"
    reads_shards = True  # packs the local shards (an offload tier reads them in first)

    def comm(self, part):
        return None

    def start(self, part, members, layout) -> Gather:
        device = members[0].local_shard().device
        pool = part.pool
        send = pool.take(layout.slot_bytes, device)
        self._pack(members, layout, send)
        rows = collectives.all_gather_rows(send, part.shard_pg, pool, async_op=True, what=part._what,
                                           gloo=config.current().gloo_all_gather, comm=self.comm(part))
        return Gather(self, send, rows, members, layout)

    def _pack(self, members, layout, send: torch.Tensor) -> None:
        dsts, srcs = [], []
        for p, offsets in zip(members, layout.offsets):
            if p.plain:  # the local shard in the parameter's own dim order (padding left as it is)
                pair = p.send_pair(send.narrow(0, offsets[0], p.pieces[0].nbytes).view(p.pieces[0].dtype))
                if pair is not None:
                    dsts.append(pair[0])
                    srcs.append(pair[1])
        if dsts:
            torch._foreach_copy_(dsts, srcs)  # casts to the compute dtype on the way

    def _targets(self, part, members, rows) -> list[list[torch.Tensor]]:
        """Per member, where its pieces' K rows are copied: its padded unsharded buffer."""
        return [[p.alloc()] for p in members]

    def _unpack(self, members, targets) -> None:
        pass

    def finish(self, part, gather: Gather) -> None:
        rows, members, layout = gather.rows, gather.members, gather.layout
        rows.wait()
        part.keep_secondary(rows, members, layout)
        targets = self._targets(part, members, rows)
        order = layout.order
        plan = part._gather_plan(members, layout)
        sizes, scattered, any_scattered = plan.sizes, plan.scattered, plan.any_scattered
        for first, seg in rows.segments:  # rank-ordered blocks of rows (on gloo this rank's row is `send`)
            if not any_scattered:  # every piece lands as bytes: one split copy
                out = [targets[i][j].narrow(0, first, seg.shape[0]) for i, j in order]
                torch.split_with_sizes_copy(seg, sizes, dim=1, out=out)
                continue
            # Shard(d > 0) pieces are copied into their slices of the contiguous unsharded tensor: as many
            # bytes as the split copy, strided; all pieces in one foreach copy
            dsts, srcs = [], []
            for i, j in order:
                src = seg.narrow(1, layout.offsets[i][j], layout.pieces[i][j].nbytes)
                if scattered[i]:
                    dtype = layout.pieces[i][j].dtype
                    if src.stride(0) % dtype.itemsize:  # a slot of quantized bytes left the rows unaligned
                        src = torch.empty(src.shape, dtype=src.dtype, device=src.device).copy_(src)
                    pairs = members[i].copy_out_pairs(src.view(dtype), first)
                else:
                    pairs = [(targets[i][j].narrow(0, first, seg.shape[0]), src)]
                dsts += [d for d, _ in pairs]
                srcs += [s for _, s in pairs]
            if dsts:
                torch._foreach_copy_(dsts, srcs)
        self._unpack(members, targets)
        for buffer in (gather.send, *rows.buffers):
            if buffer is not None:
                part.pool.give_back(buffer)

    def pool_bytes(self, part, members, layout) -> int:
        """The send row and the K - 1 rows received (plus K - 1 copies of the send row for K > 2)."""
        k = part.num_shards
        return layout.slot_bytes * (k if k == 2 else 2 * k - 1)


class QuantizedPieces(PackedRows):
    """Rows where some members' pieces are quantized: those packed into their slots (``ShardedParam.pack``),
    received into scratch pieces and dequantized (``unpack``); plain members as ``PackedRows``."""

    name = "quantized pieces"

    def _pack(self, members, layout, send: torch.Tensor) -> None:
        for p, offsets in zip(members, layout.offsets):
            if not p.plain:
                p.pack([send.narrow(0, off, piece.nbytes) for off, piece in zip(offsets, p.pieces)])
        super()._pack(members, layout, send)

    def _targets(self, part, members, rows) -> list[list[torch.Tensor]]:
        k, like = part.num_shards, rows.segments[0][1]
        return [[p.alloc()] if p.plain else [like.new_empty(k, piece.nbytes) for piece in p.pieces]
                for p in members]

    def _unpack(self, members, targets) -> None:
        for p, pieces in zip(members, targets):
            if not p.plain:
                p.unpack(pieces)


class CustomGather(QuantizedPieces):
    """The rows (plain or quantized members) through the call's custom all-gather
    (``ShardedModule.set_custom_all_gather``)."""

    name = "custom all-gather"

    def comm(self, part):
        return part.call.all_gather_comm


PACKED = PackedRows()
QUANTIZED = QuantizedPieces()
CUSTOM = CustomGather()
