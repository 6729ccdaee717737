"""A commit's copy of the local tensors into its slot, off the critical path, and what waits for it.

The parameters and the optimizer state change only at the next optimizer step, so a commit does not copy:
it starts the copy and returns. ``State`` makes every optimizer's ``step`` wait for the copy in flight (a
step pre-hook), as do the next commit, ``restore``, ``finish`` and ``close``.

On the CPU (``HostCopier``) a background thread copies the payload block by block (``checksum.BLOCK``,
1 MiB): each tensor piece of a block straight into the mapped slot (one ``copy_``, no staging buffer), then
the block's checksum while it is still in the cache; then the header, written last. ``torch`` releases the
GIL in both, so the thread runs beside the next step's forward and backward.

On CUDA (``DeviceCopier``, designed, not yet measured on a GPU) the copy is device-to-host on a side stream
into the slot itself, registered as pinned memory (``cudaHostRegister``): the side stream first waits for
the compute stream (the optimizer step that made the values), the copies are issued ``non_blocking``, an
event is recorded after them and every source tensor is marked used by the side stream (the caching
allocator does not hand its memory out while the copy reads it). The next optimizer step makes the compute
stream wait for that event (the host does not block); a background thread waits for the event on the host,
then computes the checksum over the slot and writes the header. ``Streams`` is the stream, event and pinning
interface it uses: ``CudaStreams`` on a GPU; tests drive the same logic on the CPU with their own.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from .checksum import BLOCK, Running, block_sum, checksum
from .slots import Header, SlotFile


@dataclass(frozen=True)
class Piece:
    source: int  # index of the source tensor
    at: int  # byte offset in the source
    to: int  # byte offset in the payload
    nbytes: int


def plan(spans: list[tuple[int, int]], payload_bytes: int) -> list[tuple[int, int, list[Piece]]]:
    """The copy by blocks: ``[(block start, block end, pieces)]`` covering ``payload_bytes`` in order.
    ``spans``: each source tensor's ``(payload offset, bytes)``, ascending, not overlapping."""
    blocks, k = [], 0
    for start in range(0, payload_bytes, BLOCK):
        end = min(start + BLOCK, payload_bytes)
        pieces = []
        while k < len(spans) and spans[k][0] < end:
            to, n = spans[k]
            lo, hi = max(to, start), min(to + n, end)
            if hi > lo:
                pieces.append(Piece(k, lo - to, lo, hi - lo))
            if to + n > end:
                break
            k += 1
        blocks.append((start, end, pieces))
    return blocks


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a 1-D uint8 tensor over its memory (a contiguous copy when ``t`` is not
    contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


class InFlight:
    """One commit's copy: ``wait_copied()`` before the sources change, ``result()`` the final header."""

    def __init__(self, sealed: Future, wait_copied) -> None:
        self.sealed, self._wait_copied = sealed, wait_copied

    def wait_copied(self) -> None:
        self._wait_copied()

    def result(self) -> Header:
        return self.sealed.result()


class HostCopier:
    """Copies and checksums in one background thread (CPU tensors)."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="perparam-snapshot-copy")

    def start(self, slot: SlotFile, blocks, sources: list[torch.Tensor], sizes: Header) -> InFlight:
        sealed = self.pool.submit(_copy_and_seal, slot, blocks, [flat_bytes(s) for s in sources], sizes)
        return InFlight(sealed, sealed.result)

    def close(self) -> None:
        self.pool.shutdown()


def _copy_and_seal(slot: SlotFile, blocks, sources: list[torch.Tensor], sizes: Header) -> Header:
    payload = slot.payload(sizes.payload_bytes)
    running = Running()
    for start, end, pieces in blocks:
        for p in pieces:
            payload[p.to:p.to + p.nbytes].copy_(sources[p.source][p.at:p.at + p.nbytes])
        running.add(block_sum(payload[start:end]))
    return _seal(slot, sizes, running.value)


def _seal(slot: SlotFile, sizes: Header, value: tuple[int, int]) -> Header:
    header = dataclasses.replace(sizes, payload_sum=value)
    slot.finish(header)  # written last: the slot becomes readable
    return header


class Streams(Protocol):
    """What ``DeviceCopier`` asks of the device: a side stream, events, and pinning host memory."""

    def side_waits_for_compute(self) -> None: ...
    def copy_on_side(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...  # non-blocking, side stream
    def record_on_side(self): ...  # an event after the copies issued so far
    def compute_waits(self, event) -> None: ...  # the compute stream waits for it; the host does not
    def host_waits(self, event) -> None: ...  # the host blocks until it completed
    def pin(self, slot: SlotFile) -> None: ...  # register the slot's mapping as pinned host memory
    def release(self) -> None: ...  # unregister what ``pin`` registered


class DeviceCopier:
    """Device-to-host copies on a side stream into the (pinned) slot; the checksum in a background thread."""

    def __init__(self, streams: Streams) -> None:
        self.streams = streams
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="perparam-snapshot-seal")

    def start(self, slot: SlotFile, blocks, sources: list[torch.Tensor], sizes: Header) -> InFlight:
        s = self.streams
        flats = [flat_bytes(t) for t in sources]  # a non-contiguous source's copy made on the compute stream
        s.pin(slot)
        s.side_waits_for_compute()
        payload = slot.payload(sizes.payload_bytes)
        for _, _, pieces in blocks:
            for p in pieces:
                s.copy_on_side(payload[p.to:p.to + p.nbytes], flats[p.source][p.at:p.at + p.nbytes])
        event = s.record_on_side()
        sealed = self.pool.submit(_seal_after, s, event, slot, sizes)
        return InFlight(sealed, lambda: s.compute_waits(event))

    def close(self) -> None:
        self.pool.shutdown()
        self.streams.release()


def _seal_after(streams: Streams, event, slot: SlotFile, sizes: Header) -> Header:
    streams.host_waits(event)
    return _seal(slot, sizes, checksum(slot.payload(sizes.payload_bytes)))


class CudaStreams:
    """``Streams`` on the current CUDA device."""

    def __init__(self) -> None:
        self.side = torch.cuda.Stream()
        self.pinned: dict[int, tuple[int, int]] = {}  # id(slot) -> (address, bytes) registered

    def side_waits_for_compute(self) -> None:
        self.side.wait_stream(torch.cuda.current_stream())

    def copy_on_side(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.side):
            dst.copy_(src, non_blocking=True)
        src.record_stream(self.side)  # its memory is not reused before the side stream is past the copy

    def record_on_side(self):
        return self.side.record_event()

    def compute_waits(self, event) -> None:
        torch.cuda.current_stream().wait_event(event)

    def host_waits(self, event) -> None:
        event.synchronize()

    def pin(self, slot: SlotFile) -> None:
        whole = slot.payload(slot.capacity - 4096)
        at = (whole.data_ptr(), whole.numel())
        if self.pinned.get(id(slot)) == at:
            return
        cudart = torch.cuda.cudart()
        if id(slot) in self.pinned:  # the slot was mapped anew (grown)
            cudart.cudaHostUnregister(self.pinned.pop(id(slot))[0])
        cudart.cudaHostRegister(at[0], at[1], 0)
        self.pinned[id(slot)] = at

    def release(self) -> None:
        for address, _ in self.pinned.values():
            torch.cuda.cudart().cudaHostUnregister(address)
        self.pinned.clear()


def copier_for(sources: list[torch.Tensor]):
    """``DeviceCopier(CudaStreams())`` when any source is on a CUDA device, else ``HostCopier()``."""
    if any(t.is_cuda for t in sources):
        return DeviceCopier(CudaStreams())
    return HostCopier()
