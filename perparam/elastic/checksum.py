"""The snapshot payload's checksum: a position-weighted sum of 64-bit words, computed with torch in blocks.

The payload is read as little-endian 64-bit words (a tail shorter than 8 bytes padded with zeros) in blocks
of ``BLOCK`` bytes; ``S_i`` is the wrapped sum of block ``i``'s words. The checksum is the pair
``(sum S_i, sum (i + 1) * S_i)``, both mod 2**64. A flipped bit changes one ``S_i`` by a power of two (never 0
mod 2**64), so it is always refused; blocks swapped or shifted change the second sum. It is not a
cryptographic hash (errors built to cancel pass); it stands where ``zlib.crc32`` stood because it is one
vectorized pass and, block by block, it reads each block while the copy that wrote it left it in the cache
(``Running``, ``copier.py``). Its cost beside the copy: ``benchmarks/README.md``, elastic_snapshot.
"""

from __future__ import annotations

import torch

BLOCK = 1 << 20  # bytes; a multiple of 8
MASK = (1 << 64) - 1


def block_sum(block: torch.Tensor) -> int:
    """The wrapped sum (an unsigned 64-bit int) of ``block``'s 64-bit words. ``block``: a 1-D uint8 tensor
    whose first byte is 8-byte aligned in memory; any length (a tail padded with zeros)."""
    n = block.numel()
    whole = n - n % 8
    total = int(block[:whole].view(torch.int64).sum()) if whole else 0
    if whole != n:
        tail = torch.zeros(8, dtype=torch.uint8)
        tail[:n - whole] = block[whole:]
        total += int(tail.view(torch.int64)[0])
    return total & MASK


class Running:
    """The checksum built block by block, in payload order: ``add(S_i)`` for ``i = 0, 1, ...``; ``value``."""

    def __init__(self) -> None:
        self.first = self.second = self.blocks = 0

    def add(self, block_total: int) -> None:
        self.blocks += 1
        self.first = (self.first + block_total) & MASK
        self.second = (self.second + self.blocks * block_total) & MASK

    @property
    def value(self) -> tuple[int, int]:
        return self.first, self.second


def checksum(payload: torch.Tensor) -> tuple[int, int]:
    """The checksum of ``payload`` (a 1-D uint8 tensor, 8-byte aligned) in one vectorized pass over its whole
    blocks (torch's threads), the same value ``Running`` gives block by block."""
    n = payload.numel()
    whole = n // BLOCK
    running = Running()
    if whole:
        sums = payload[:whole * BLOCK].view(torch.int64).view(whole, BLOCK // 8).sum(dim=1)
        weights = torch.arange(1, whole + 1, dtype=torch.int64)
        running.first = int(sums.sum()) & MASK
        running.second = int((sums * weights).sum()) & MASK
        running.blocks = whole
    if n > whole * BLOCK:
        running.add(block_sum(payload[whole * BLOCK:]))
    return running.value
