"""The replica of each rank's snapshot, kept by a rank on the next node: sent point-to-point over gloo.

Rank ``r`` sends to ``(r + local_world_size) % world`` (the same local rank on the next node), and receives
from ``(r - local_world_size) % world``; on one node (``local_world_size == world``) the offset is 1, so the
replica is still sent and kept, and the memory is the same on one node as on many. One gloo process group of
its own carries the transfers, apart from training's collectives.

A commit exchanges the 64-byte slot headers (one small send and receive, waited), then starts the payload's
send and receive (``isend``/``irecv`` into the holder's mapped replica slot) and returns: the transfer runs
while the next step computes. The next commit (or ``finish``) waits for it and only then writes the replica
slot's header, so a holder killed mid-transfer leaves the slot refused, never half-read. Every c10d work is
dropped once it is waited on (CONTRIBUTING, "Known open problems").
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .errors import SnapshotError
from .slots import HEADER_BYTES, Header, SlotFile
from .store import Store

HEADER_TAG, PAYLOAD_TAG = 71, 72


def neighbours(rank: int, world: int, local_world: int | None = None) -> tuple[int, int]:
    """``(target, source)``: the rank that keeps this rank's replica, and the rank whose replica it keeps."""
    local = local_world if local_world is not None else int(os.environ.get("LOCAL_WORLD_SIZE", world))
    offset = local if 0 < local < world else 1
    return (rank + offset) % world, (rank - offset) % world


class ReplicaLink:
    """This rank's two transfers of each commit: its snapshot out to ``target``, ``source``'s in."""

    def __init__(self, store: Store, rank: int, world: int, group) -> None:
        self.store, self.group = store, group
        self.target, self.source = neighbours(rank, world)
        self._pending: tuple | None = None

    def send(self, header: Header, slot: SlotFile) -> None:
        """Exchange headers (waited), then start the payloads' transfer (not waited)."""
        self.finish()
        out = torch.frombuffer(bytearray(header.pack()), dtype=torch.uint8)
        inbox = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        works = [dist.isend(out, self.target, group=self.group, tag=HEADER_TAG),
                 dist.irecv(inbox, self.source, group=self.group, tag=HEADER_TAG)]
        for w in works:
            w.wait()
        del works
        theirs = Header.unpack(bytes(inbox.numpy()))
        if theirs is None or theirs.origin != self.source:
            raise SnapshotError(f"the snapshot header received from rank {self.source} is damaged: its replica cannot "
                                "be kept (a rank running another perparam version, or a corrupted transfer)")
        held = self.store.held(theirs.origin, theirs.generation % 2)
        held.begin(theirs.payload_bytes)
        receive = dist.irecv(held.payload(theirs.payload_bytes), self.source, group=self.group, tag=PAYLOAD_TAG)
        send = dist.isend(slot.payload(header.payload_bytes), self.target, group=self.group, tag=PAYLOAD_TAG)
        self._pending = (send, receive, held, theirs)

    def finish(self) -> None:
        """Wait for the transfers in flight; the received replica becomes readable (its header written)."""
        if self._pending is None:
            return
        send, receive, held, theirs = self._pending
        self._pending = None
        send.wait()
        receive.wait()
        del send, receive
        held.finish(theirs)
