"""The replica of each rank's snapshot, kept by a rank on the next node: sent point-to-point over gloo.

Placement (``replica_wanted``): ``"auto"`` (the default) keeps a replica only when the job spans more than one
node: a replica on the same host dies with the host, like the own slot, and protects against nothing the own
slot does not; ``"always"`` keeps one even on one node (what tests of the replica path and a user who wants
the copy outside the own slot's file choose); ``"off"`` never. Nodes are counted from the elastic agent's
``LOCAL_WORLD_SIZE`` (``world / local_world_size``), else from the ranks' host names (gathered).

Rank ``r`` sends to ``(r + local_world_size) % world`` (the same local rank on the next node), and receives
from ``(r - local_world_size) % world``; on one node (``local_world_size == world``, ``"always"``) the offset
is 1. One gloo process group of its own carries the transfers, apart from training's collectives.

A commit exchanges the 64-byte slot headers (one small send and receive, waited: the sizes, before the
checksum is known), then posts the payload's receive (``irecv`` into the holder's mapped replica slot) and
returns; ``post`` starts the send (``isend`` from the own slot) once the background copy has written the
slot (``State`` calls it before the next optimizer step): the transfer runs while the next step computes.
The next commit (or ``finish``) waits for it, exchanges the final headers (with the payload's checksum,
computed off the critical path by the sender) and only then writes the replica slot's header, so a holder
killed mid-transfer leaves the slot refused, never half-read. Every c10d work is dropped once it is waited on
(CONTRIBUTING, "Known open problems").
"""

from __future__ import annotations

import os
import socket

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


REPLICA_MODES = ("auto", "always", "off")


def replica_wanted(mode: str, world: int) -> bool:
    """Whether this job keeps replicas (``mode``: ``"auto"``, ``"always"`` or ``"off"``; the same on every
    rank). ``"auto"`` on a job without ``LOCAL_WORLD_SIZE`` gathers the host names: a collective."""
    if mode != "auto" or world < 2:
        return mode == "always" and world > 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if local:
        return local < world
    hosts: list = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    return len(set(hosts)) > 1


class ReplicaLink:
    """This rank's two transfers of each commit: its snapshot out to ``target``, ``source``'s in."""

    def __init__(self, store: Store, rank: int, world: int, group) -> None:
        self.store, self.group = store, group
        self.target, self.source = neighbours(rank, world)
        self._pending: tuple | None = None
        self._outgoing: tuple | None = None

    def _exchange(self, header: Header) -> Header:
        out = torch.frombuffer(bytearray(header.pack()), dtype=torch.uint8)
        inbox = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        works = [dist.isend(out, self.target, group=self.group, tag=HEADER_TAG),
                 dist.irecv(inbox, self.source, group=self.group, tag=HEADER_TAG)]
        for w in works:
            w.wait()
        del works
        theirs = Header.unpack(bytes(inbox.numpy()))
        if theirs is None or theirs.origin != self.source:
            raise SnapshotError(f"the snapshot header received from rank {self.source} is damaged: its "
                                "replica cannot be kept (a rank running another perparam version, or a "
                                "corrupted transfer)")
        return theirs

    def send(self, sizes: Header, slot: SlotFile, final) -> None:
        """Exchange the sizes (waited) and start receiving the source's payload (not waited). ``post()``
        starts sending this rank's once its slot is written; ``final()`` gives this rank's final header
        (checksum included) once it is known; ``finish`` sends it."""
        self.finish()
        theirs = self._exchange(sizes)
        held = self.store.held(theirs.origin, theirs.generation % 2)
        held.begin(theirs.payload_bytes)
        receive = dist.irecv(held.payload(theirs.payload_bytes), self.source, group=self.group,
                             tag=PAYLOAD_TAG)
        self._pending = (None, receive, held, theirs, final)
        self._outgoing = (slot, sizes)

    def post(self) -> None:
        """Start sending this rank's payload (its slot written): at most once per ``send``."""
        if self._outgoing is None:
            return
        (slot, sizes), self._outgoing = self._outgoing, None
        send = dist.isend(slot.payload(sizes.payload_bytes), self.target, group=self.group, tag=PAYLOAD_TAG)
        self._pending = (send, *self._pending[1:])

    def finish(self) -> None:
        """Wait for the transfers in flight, exchange the final headers; the received replica becomes readable
        (its header written)."""
        if self._pending is None:
            return
        final_header = self._pending[4]()  # the own slot written and checksummed
        self.post()
        send, receive, held, sizes, final = self._pending
        self._pending = None
        send.wait()
        receive.wait()
        del send, receive
        theirs = self._exchange(final_header)
        if (theirs.generation, theirs.payload_bytes) != (sizes.generation, sizes.payload_bytes):
            raise SnapshotError(f"the final snapshot header from rank {self.source} (step "
                                f"{theirs.generation}) does not match the transfer it announced (step "
                                f"{sizes.generation}): its replica is not kept")
        held.finish(theirs)
