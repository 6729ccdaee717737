"""The ``"cpu"`` tier of optimizer state on a CUDA mesh: pinned host copies, device storage freed between
steps (untested here: no GPU on the development machine; ``benchmarks/gpu_check.py`` checks it).

``HostSlot(label, tensor, pin)`` keeps a host copy of one device tensor (pinned when ``pin``: the copies
can then run asynchronously). ``evict`` copies device -> host (waits for it: the device storage is freed
right after) and resizes the device storage to 0 bytes; ``fetch`` gives the storage back and copies host
-> device on a side stream, so the copy overlaps the rest of backward; ``wait`` makes the current stream
wait for that copy (a stream wait, as FSDP2's waits on its copy events: the host does not block). The optimizer step runs on the device, as without offload:
a parameter group never mixes host and device tensors, so no optimizer falls back to a slow path.
"""

from __future__ import annotations

import time

import torch

from .mapped import STATS


class HostSlot:
    def __init__(self, label: str, tensor: torch.Tensor, pin: bool) -> None:
        self.label = label
        self.tensor = tensor
        self.nbytes = tensor.numel() * tensor.element_size()
        self.host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
        self.ptr = tensor.data_ptr()
        self.resident = True
        self._event = None
        self._stream = None

    def holds(self, tensor: torch.Tensor) -> bool:
        return tensor is self.tensor and tensor.numel() * tensor.element_size() == self.nbytes

    def evict(self, write: bool = True) -> None:
        if not self.resident:
            return
        t0 = time.perf_counter()
        if write:
            self.host.copy_(self.tensor)  # synchronous: the storage is freed next
        self.tensor.untyped_storage().resize_(0)
        self.resident = False
        STATS.add(bytes_written=self.nbytes if write else 0, evict_s=time.perf_counter() - t0)

    def fetch(self) -> None:
        if self.resident:
            return
        self.tensor.untyped_storage().resize_(self.nbytes)
        device = self.tensor.device
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        self._stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._stream):
            self.tensor.copy_(self.host, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(self._stream)
        self.tensor.record_stream(self._stream)
        self.resident = True
        STATS.add(bytes_fetched=self.nbytes)

    def wait(self) -> None:
        """Make the current stream wait for the host-to-device copy (a stream wait: the host goes on; the
        optimizer step's kernels start once the copy is done). ``STATS.wait_s`` counts the host time of the
        call, which is no longer the copy time backward did not hide; ``benchmarks/gpu_check.py``'s cpu_tier
        section measures that as step time."""
        if self._event is not None:
            t0 = time.perf_counter()
            torch.cuda.current_stream(self.tensor.device).wait_event(self._event)
            STATS.add(wait_s=time.perf_counter() - t0)
            self._event = None
