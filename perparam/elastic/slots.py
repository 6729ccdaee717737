"""One snapshot slot: a file in host shared memory (``/dev/shm``) holding one rank's state at one generation.

A slot file is a 64-byte header, then (from byte ``PAYLOAD_AT``) the payload: the pickled description, then
the tensors' bytes, each at a 64-byte boundary. The file outlives the process that wrote it (tmpfs: the
memory of the node, gone with the node), so a worker killed by any signal leaves its slots readable.

Torn writes: ``begin`` zeroes the header first, the payload is written, and ``finish`` writes the header
last, with the generation, the payload's checksum (``checksum.py``) and the header's own CRC-32. A reader
(``read_header``, ``Slot.verify``) takes a slot only when the header is whole and the payload's checksum
matches: a writer killed mid-commit leaves a zeroed or older header (refused), a flipped bit anywhere is
refused by a checksum.

Header layout (little-endian): magic ``PPSNAP02`` (8 bytes), generation (u64), payload bytes (u64),
description bytes (u64), the payload checksum's two words (u64, u64), origin rank (u32), world size (u32),
header CRC-32 (u32) of the 56 bytes before it; then zeros to 64 bytes.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from .checksum import checksum

MAGIC = b"PPSNAP02"
HEADER = struct.Struct("<8sQQQQQII")
HEADER_BYTES = 64
PAYLOAD_AT = 4096
ALIGN = 64


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Header:
    generation: int
    payload_bytes: int
    description_bytes: int
    payload_sum: tuple[int, int]  # checksum.checksum of the payload
    origin: int
    world_size: int

    def pack(self) -> bytes:
        body = HEADER.pack(MAGIC, self.generation, self.payload_bytes, self.description_bytes,
                           *self.payload_sum, self.origin, self.world_size)
        return (body + struct.pack("<I", zlib.crc32(body))).ljust(HEADER_BYTES, b"\0")

    @staticmethod
    def unpack(raw: bytes) -> Header | None:
        """The header in ``raw`` (64 bytes), or None when it is zeroed, foreign or damaged."""
        body = bytes(raw[:HEADER.size])
        if len(raw) < HEADER.size + 4 or body[:8] != MAGIC:
            return None
        (crc,) = struct.unpack_from("<I", raw, HEADER.size)
        if zlib.crc32(body) != crc:
            return None
        _, gen, payload, description, first, second, origin, world = HEADER.unpack(body)
        return Header(gen, payload, description, (first, second), origin, world)


def _quiet_frombuffer(buf, count: int, offset: int) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only mapping: the tensor is only read from
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(buf, dtype=torch.uint8, count=count, offset=offset)


class SlotFile:
    """A slot this process writes: the file mapped shared, grown (never shrunk) to fit the payload."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self.map: mmap.mmap | None = None
        self.capacity = 0

    def begin(self, payload_bytes: int) -> None:
        """Invalidate the slot (header zeroed first) and make room for ``payload_bytes``."""
        need = PAYLOAD_AT + payload_bytes
        if self.map is None or need > self.capacity:
            if self.map is not None:
                self.map[:HEADER_BYTES] = bytes(HEADER_BYTES)
                self.map.close()
            os.ftruncate(self.fd, need)
            self.map = mmap.mmap(self.fd, need, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self.capacity = need
        self.map[:HEADER_BYTES] = bytes(HEADER_BYTES)

    def payload(self, nbytes: int, offset: int = 0) -> torch.Tensor:
        """``nbytes`` of the payload from ``offset``, as a uint8 tensor over the mapping (no copy)."""
        return torch.frombuffer(self.map, dtype=torch.uint8, count=nbytes, offset=PAYLOAD_AT + offset)

    def checksum(self, payload_bytes: int) -> tuple[int, int]:
        """``checksum.checksum`` of the first ``payload_bytes`` of the payload."""
        return checksum(self.payload(payload_bytes))

    def finish(self, header: Header) -> None:
        """Make the slot readable: the header, written last."""
        self.map[:HEADER_BYTES] = header.pack()

    def close(self) -> None:
        if self.map is not None:
            with contextlib.suppress(BufferError):  # tensors still view it: the mapping goes with them
                self.map.close()
            self.map = None
        os.close(self.fd)


def read_header(path: Path) -> Header | None:
    """A slot file's header, or None when the file is missing, short, being written or damaged."""
    try:
        with open(path, "rb") as f:
            return Header.unpack(f.read(HEADER_BYTES))
    except OSError:
        return None


class Slot:
    """A slot read back (mapped read-only): ``verify`` checks the payload against the header's checksum."""

    def __init__(self, path: Path, header: Header) -> None:
        self.path, self.header = Path(path), header
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            self.map = mmap.mmap(f.fileno(), 0, mmap.MAP_SHARED, mmap.PROT_READ) if size else None
        self.size = size

    def verify(self) -> bool:
        h = self.header
        if self.map is None or self.size < PAYLOAD_AT + h.payload_bytes:
            return False
        if Header.unpack(self.map[:HEADER_BYTES]) != h:  # rewritten since the header was read
            return False
        return checksum(self.payload()) == h.payload_sum

    def description(self) -> bytes:
        return bytes(self.map[PAYLOAD_AT:PAYLOAD_AT + self.header.description_bytes])

    def payload(self) -> torch.Tensor:
        return _quiet_frombuffer(self.map, self.header.payload_bytes, PAYLOAD_AT)

    def close(self) -> None:
        if self.map is not None:
            with contextlib.suppress(BufferError):  # tensors still view it: the mapping goes with them
                self.map.close()
            self.map = None
