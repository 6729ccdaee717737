"""A pool of byte buffers for the collectives' transient send/receive buffers (CPU only), bounded in bytes.

**What is pooled.** glibc maps every allocation of 32 MiB or more (its largest mmap threshold,
``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit) anew and page-faults it in on first touch, every time. Smaller
buffers come back from glibc's heap without faults, and memory freed there is reused by activations and
gradients; keeping them idle in a pool only raised the benchmark's training-phase peak, at the same CPU per
step (both measured by ``step_time``: benchmarks/README.md, "The gloo collectives and the buffer pool").
So only buffers of at least
``MIN_POOLED_BYTES`` are kept. CUDA's caching allocator already reuses memory, so CUDA buffers are never
pooled.

**Bound.** A pool keeps at most ``max_idle_bytes`` bytes of idle buffers; a buffer given back beyond that
is dropped (freed). Each root's ``IterationContext`` (``perparam.runtime.context``) owns one pool and sets the
bound to ``IN_FLIGHT_GROUPS`` times the largest group's ``ParamGroup.pool_bytes()`` (its all-gather and
reduce-scatter buffers together): with one group prefetched, a step never has more than two groups'
buffers in use at once, so that much idle memory lets every pooled buffer of a step be reused and nothing
more is kept. Two models in one process never hand each other buffers.

**The owner path's pool.** The owner step's all-to-alls (``perparam.runtime.owner_exchange``) take their
send and receive buffers from a pool of their own, kept with the owner plan: every size (``min_bytes=0``),
unbounded (what one step holds at once, since a step asks for the sizes the last one did), smallest fit
(a scatter reuses a gather's buffer): packing a bucket's rows into fresh buffers costs page faults every
step, into buffers already touched a few of them. What the pool saves and keeps idle between steps, on CPU
only: ``muon_step`` in benchmarks/README.md.
"""

from __future__ import annotations

import torch

#: groups whose buffers are in use at once: the current one and the one prefetched
#: (``perparam.configure(prefetch=...)``)
IN_FLIGHT_GROUPS = 2
#: smaller buffers are left to glibc's heap (see the module docstring)
MIN_POOLED_BYTES = 32 << 20


class BufferPool:
    """Idle uint8 CPU buffers of at least ``min_bytes`` bytes, at most ``max_idle_bytes`` bytes in all
    (``None``: unbounded), handed out by exact size; with ``smallest_fit`` (the owner path's exchanges,
    ``perparam.runtime.owner_exchange``, whose gathers and scatters differ in size), else the smallest idle
    buffer that is large enough, as a view of its first bytes."""

    def __init__(self, max_idle_bytes: int | None = None, min_bytes: int = MIN_POOLED_BYTES,
                 smallest_fit: bool = False) -> None:
        self.max_idle_bytes = max_idle_bytes
        self.min_bytes = min_bytes
        self.smallest_fit = smallest_fit
        self._idle: dict[tuple[int, torch.device], list[torch.Tensor]] = {}
        self._idle_bytes = 0
        self.allocations = 0  # buffers ``take`` had to allocate (none once a step's sizes are pooled)

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A uint8 buffer of ``nbytes`` bytes (contents undefined): an idle pooled one, or a new one."""
        if device.type == "cpu" and nbytes:
            key = (nbytes, device)
            if not self._idle.get(key) and self.smallest_fit:
                key = min(((n, d)
                           for (n, d), idle in self._idle.items() if idle and d == device and n >= nbytes),
                          default=key)
            idle = self._idle.get(key)
            if idle:
                self._idle_bytes -= key[0]
                whole = idle.pop()
                return whole if key[0] == nbytes else whole[:nbytes]
        self.allocations += bool(nbytes)
        with torch.inference_mode(False):  # a pooled buffer outlives an inference_mode forward
            return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def give_back(self, buffer: torch.Tensor) -> None:
        """Return a buffer from ``take`` (or a view of one) once nothing uses it any more (its collective has
        finished). Its whole storage is kept for reuse if it has at least ``min_bytes``, is not idle already
        and the pool's idle bytes stay within ``max_idle_bytes``; otherwise dropped."""
        if buffer.device.type != "cpu" or not buffer.numel():
            return
        storage = buffer.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes < self.min_bytes or (self.max_idle_bytes is not None
                                       and self._idle_bytes + nbytes > self.max_idle_bytes):
            return
        idle = self._idle.setdefault((nbytes, buffer.device), [])
        if any(b.untyped_storage().data_ptr() == storage.data_ptr() for b in idle):
            return  # given back twice
        # a fresh uint8 tensor over the whole storage, made outside inference mode: a view made under
        # inference_mode (the buffer may be one) could not be written in place later
        with torch.inference_mode(False):
            whole = torch.empty(0, dtype=torch.uint8, device=buffer.device)
            whole.set_(storage, 0, (nbytes,))
        idle.append(whole)
        self._idle_bytes += nbytes

    def idle_bytes(self) -> int:
        """Bytes held by idle buffers."""
        return self._idle_bytes

    def clear(self) -> None:
        """Drop every idle buffer (e.g. before measuring memory)."""
        self._idle.clear()
        self._idle_bytes = 0
