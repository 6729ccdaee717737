"""hpZ's secondary all-gather (ZeRO++, FSDP2's ``reshard_after_forward=int``): in backward the rows a rank
kept from the forward all-gather over the K ranks (``perparam.runtime.hpz.Secondary``: ``K/k'`` rows of the
packed uint8 buffer, ``[K, slot]``) are all-gathered over its secondary group of k' ranks, through the
custom all-gather when one is set; concatenated in member order they are the K rows again, in rank order,
and are copied out exactly as after the forward all-gather (``gather_rows``: quantized pieces included,
what is kept is what was on the wire). Bytes: ``k' * K/k' * slot`` per rank, over the k' ranks only."""

from __future__ import annotations

from ...comm import collectives
from ...comm.collectives import GatheredRows
from .. import config
from .gather import Gather
from .gather_rows import CustomGather


class HpzSecondary(CustomGather):
    """hpZ: the rows kept from the forward all-gather, all-gathered over the secondary group (through the
    custom all-gather when one is set); copied out as after the forward all-gather."""

    name = "hpZ secondary"
    reads_shards = False  # the kept rows are what was on the wire

    def start(self, part, members, layout) -> Gather:
        """All-gather the part's kept rows over its secondary group (asynchronously): one collective, the same
        output as the forward all-gather, its segments numbered as the K ranks'. The kept buffer is handed
        over (``Secondary.hand_over``) and given back to the pool with the received rows."""
        hpz = part.hpz
        kept, rpm = hpz.hand_over(), hpz.rows_per_member
        rows = collectives.all_gather_rows(kept.reshape(-1), hpz.pg, part.pool, async_op=True,
                                           what=f"{part._what} (hpZ)", gloo=config.current().gloo_all_gather,
                                           comm=self.comm(part))
        segments = [(first * rpm, seg.reshape(seg.shape[0] * rpm, -1)) for first, seg in rows.segments]
        return Gather(self, None, GatheredRows(rows.work, segments, [*rows.buffers, kept]), members, layout)


HPZ_SECONDARY = HpzSecondary()
