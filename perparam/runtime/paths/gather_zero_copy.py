"""The zero-copy all-gather path (``perparam.runtime.zero_copy``): each member's buffer receives the peers'
rows in place, one send and one receive per member and peer; nothing is copied out."""

from __future__ import annotations

from .. import zero_copy
from .gather import Gather
from .gather_rows import PACKED


class ZeroCopyGather:
    name = "zero-copy"
    reads_shards = True

    def start(self, part, members, layout) -> Gather:
        rows = zero_copy.start(members, part.shard_pg, layout.slot_bytes, part._what)
        if rows is None:  # a local shard is not on the CPU: the packed rows (the members are plain)
            return PACKED.start(part, members, layout)
        return Gather(self, None, rows, members, layout)

    def finish(self, part, gather: Gather) -> None:
        gather.rows.wait()  # the pieces arrived in the buffers

    def pool_bytes(self, part, members, layout) -> int:
        if all(p.local_shard().device.type == "cpu" for p in members):
            return 0  # straight into the parameters' buffers
        return PACKED.pool_bytes(part, members, layout)


ZERO_COPY = ZeroCopyGather()
