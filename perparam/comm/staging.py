"""Staging buffers reused across optimizer steps (the owner path's all-to-all send and receive buffers,
``perparam.runtime.owner_exchange``), CPU only.

Fresh large CPU buffers page-fault in on first touch, every time glibc maps them anew: measured on the
27.4M GPT at K = 2, packing a bucket's rows with ``torch.cat`` into a new buffer cost 26-33 ms per step
against a few ms into one already touched. A ``StagingPool`` keeps the buffers a step gave back and hands
an idle one of exactly the bytes asked for, else the smallest idle one that fits (a view of its first
bytes), to the next request, so after the first step
every staging buffer is memory already touched. Its idle bytes are bounded by what one step held at once
(a step takes the same sizes again), and by ``max_idle_bytes``: a buffer given back beyond it is dropped.
CUDA buffers are never kept (the caching allocator reuses memory already).
"""

from __future__ import annotations

import torch

__all__ = ["StagingPool"]


class StagingPool:
    """Idle uint8 CPU buffers, handed out exact size first, else smallest-fit (a view of the first bytes of an
    idle one that is large enough), else new; at most ``max_idle_bytes`` idle in all (``None``: unbounded)."""

    def __init__(self, max_idle_bytes: int | None = None) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._idle: list[torch.Tensor] = []  # whole buffers, by size ascending
        self._idle_bytes = 0
        self.allocations = 0  # buffers ``take`` had to allocate (none once a step's sizes are pooled)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D ``dtype`` tensor of ``numel`` elements (contents undefined) on ``device``. Give it back with
        ``give_back`` once nothing reads or writes it any more (its collective has finished)."""
        nbytes = numel * dtype.itemsize
        if nbytes and device.type == "cpu":
            fits = [i for i, buf in enumerate(self._idle) if buf.numel() >= nbytes and buf.device == device]
            if fits:  # one of exactly these bytes first (a step asks for the sizes the last one did), else the smallest
                i = next((i for i in fits if self._idle[i].numel() == nbytes), fits[0])
                buf = self._idle.pop(i)
                self._idle_bytes -= buf.numel()
                return buf[:nbytes].view(dtype)
        self.allocations += bool(nbytes)
        with torch.inference_mode(False):  # kept across steps: must be writable outside inference mode too
            return torch.empty(numel, dtype=dtype, device=device)

    def give_back(self, buffer: torch.Tensor) -> None:
        """Return a tensor from ``take``: its whole storage is kept for reuse while the idle bytes stay
        within ``max_idle_bytes``, else dropped."""
        if buffer.device.type != "cpu":
            return
        storage = buffer.untyped_storage()
        nbytes = storage.nbytes()
        if not nbytes or (self.max_idle_bytes is not None and self._idle_bytes + nbytes > self.max_idle_bytes):
            return
        if any(b.untyped_storage().data_ptr() == storage.data_ptr() for b in self._idle):
            return  # given back twice (a K = 1 exchange's receive buffer is its send buffer)
        with torch.inference_mode(False):
            whole = torch.empty(0, dtype=torch.uint8, device=buffer.device)
            whole.set_(storage, 0, (nbytes,))
        self._idle.append(whole)
        self._idle.sort(key=torch.Tensor.numel)
        self._idle_bytes += nbytes

    def idle_bytes(self) -> int:
        """Bytes held by idle buffers."""
        return self._idle_bytes

    def clear(self) -> None:
        """Drop every idle buffer."""
        self._idle.clear()
        self._idle_bytes = 0
