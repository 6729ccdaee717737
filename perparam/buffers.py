"""A small pool of byte buffers for the collectives' transient send/receive buffers (CPU only).

On CPU every fresh buffer above glibc's mmap threshold (32 MiB) is mapped anew and page-faulted in on
first touch; a group's all-gather and reduce-scatter buffers are that large and are needed every step.
Keeping at most ``idle_per_size`` idle buffers of each size removes those faults (measured: about half
of the page faults of a step of the 27M-parameter benchmark model). CUDA's caching allocator already
does this, so CUDA buffers are not pooled.

Each root's ``IterationContext`` owns one pool (``perparam.state``): two models in one process never
hand each other buffers. A pool holds at most ``idle_per_size`` idle buffers per distinct size; with
prefetching, 2 all-gathers and 2 reduce-scatters are in flight at once, so 4 per size covers a step.
"""

from __future__ import annotations

import torch

IDLE_PER_SIZE = 4


class BufferPool:
    """Idle uint8 CPU buffers keyed by (bytes, device)."""

    def __init__(self, idle_per_size: int = IDLE_PER_SIZE) -> None:
        self.idle_per_size = idle_per_size
        self._idle: dict[tuple[int, torch.device], list[torch.Tensor]] = {}

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A uint8 buffer of ``nbytes`` bytes (contents undefined): an idle pooled one, or a new one."""
        if device.type == "cpu":
            idle = self._idle.get((nbytes, device))
            if idle:
                return idle.pop()
        with torch.inference_mode(False):  # a pooled buffer outlives an inference_mode forward
            return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def give_back(self, buffer: torch.Tensor) -> None:
        """Return a buffer from ``take`` once nothing uses it any more (its collective has finished)."""
        if buffer.device.type != "cpu" or not buffer.numel():
            return
        storage = buffer.untyped_storage()
        idle = self._idle.setdefault((storage.nbytes(), buffer.device), [])
        if len(idle) < self.idle_per_size:
            # a fresh uint8 tensor over the whole storage, made outside inference mode: a view made under
            # inference_mode (the buffer may be one) could not be written in place later
            with torch.inference_mode(False):
                whole = torch.empty(0, dtype=torch.uint8, device=buffer.device)
                whole.set_(storage, 0, (storage.nbytes(),))
            idle.append(whole)

    def idle_bytes(self) -> int:
        """Bytes held by idle buffers."""
        return sum(b.numel() for bufs in self._idle.values() for b in bufs)

    def clear(self) -> None:
        """Drop every idle buffer (e.g. before measuring memory)."""
        self._idle.clear()
