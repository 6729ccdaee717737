"""The ``"cpu"`` tier of optimizer state on a device mesh: host copies (pinned on CUDA), device storage freed
between steps.

``HostSlot(label, tensor, pin)`` keeps a host copy of one device tensor (pinned when ``pin``: the copies
can then run asynchronously). ``evict_all`` (``evict`` for one) copies device -> host on a side stream, waits
once for all of them (the device storage is freed right after) and resizes the device storage to 0 bytes;
``fetch`` gives the storage back and copies host -> device on a side stream, so the copy overlaps the rest of
backward; ``wait`` makes the current stream wait for that copy (a stream wait, as FSDP2's waits on its copy
events: the host does not block). The optimizer step runs on the device, as without offload: a parameter group
never mixes host and device tensors, so no optimizer falls back to a slow path.

Between steps the optimizer's state entry is the host copy (``park``; a DTensor keeps its spec around the
host tensor, as torch's CPU state dicts do), never the device tensor over freed storage: a logged norm of
``optimizer.state[p][key]`` reads the values (a sharded norm's all-reduce then needs a backend for CPU
tensors, ``"cpu:gloo,cuda:nccl"``, as FSDP2's ``CPUOffloadPolicy`` state does). ``unpark`` puts the device
tensor back before the step (and before ``optimizer.state_dict()``, which brings the state in first).

The streams and events are the device's (``torch.get_device_module``): CUDA's on a GPU; on CPU (what the
test suite runs, ``tests/test_offload_host.py``) they are torch's no-op CPU ones and the copies synchronous.
"""

from __future__ import annotations

import time

import torch
from torch.distributed.tensor import DTensor

from .mapped import STATS


class HostSlot:
    def __init__(self, label: str, tensor: torch.Tensor, pin: bool) -> None:
        self.label = label
        self.tensor = tensor
        self.nbytes = tensor.numel() * tensor.element_size()
        self.host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu",
                                pin_memory=pin and tensor.device.type != "cpu")
        self.ptr = tensor.data_ptr()
        self.resident = True
        self._event = None
        self._stream = None
        self._device = torch.get_device_module(tensor.device.type)
        self._parked: tuple[object, object] | None = None  # (the state's device value, its host stand-in)

    def holds(self, tensor: torch.Tensor) -> bool:
        return tensor is self.tensor and tensor.numel() * tensor.element_size() == self.nbytes

    def evict(self, write: bool = True) -> None:
        evict_all([self], write)

    def fetch(self) -> None:
        if self.resident:
            return
        self.tensor.untyped_storage().resize_(self.nbytes)
        device, streams = self.tensor.device, self._device
        current = streams.current_stream(device)
        if self._stream is None:  # (torch.cpu.Stream takes no device)
            self._stream = streams.Stream(device) if device.type != "cpu" else streams.Stream()
        self._stream.wait_stream(current)
        with streams.stream(self._stream):
            self.tensor.copy_(self.host, non_blocking=device.type != "cpu")
            self._event = streams.Event()
            self._event.record(self._stream)
        if device.type != "cpu":
            self.tensor.record_stream(self._stream)
        self.resident = True
        STATS.add(bytes_fetched=self.nbytes)

    def wait(self) -> None:
        """Make the current stream wait for the host-to-device copy (a stream wait: the host goes on; the
        optimizer step's kernels start once the copy is done). ``STATS.wait_s`` counts the host time of the
        call, which is no longer the copy time backward did not hide; ``benchmarks/gpu/check.py``'s cpu_tier
        section measures that as step time."""
        if self._event is not None:
            t0 = time.perf_counter()
            self._device.current_stream(self.tensor.device).wait_event(self._event)
            STATS.add(wait_s=time.perf_counter() - t0)
            self._event = None

    def park(self, state: dict, key: str) -> None:
        """After ``evict``: ``state[key]`` (the optimizer's entry for this slot's tensor) becomes the host
        copy (a DTensor of the same spec around it, for a DTensor entry) until ``unpark``."""
        value = state.get(key)
        local = value._local_tensor if isinstance(value, DTensor) else value
        if self.resident or local is not self.tensor:
            return
        host = DTensor(self.host, value._spec,
                       requires_grad=False) if isinstance(value, DTensor) else self.host
        state[key] = host
        self._parked = (value, host)

    def unpark(self, state: dict, key: str) -> None:
        """``state[key]`` back to the device tensor, if it is still the host stand-in ``park`` put there (an
        entry replaced in between, e.g. by ``load_state_dict``, is left alone)."""
        if self._parked is not None:
            value, host = self._parked
            if state.get(key) is host:
                state[key] = value
            self._parked = None


def tier_moves(device_type: str) -> bool:
    """Whether the ``"cpu"`` tier moves state off a mesh of ``device_type``: on a CPU mesh host memory *is*
    the device memory, so the tier is a no-op there (``tests/test_offload_host.py`` runs it on CPU all the
    same, by making this return True in its ranks)."""
    return device_type != "cpu"


def slots_of(po) -> list[tuple[str, HostSlot]]:
    """``(state key, slot)`` of a ``ParamOffload``'s optimizer state held by this tier."""
    return [(key, slot) for key, slot in po.state_slots.items() if isinstance(slot, HostSlot)]


_SIDE: dict = {}  # device -> the stream the evictions' device-to-host copies run on


def evict_all(slots: list[HostSlot], write: bool = True) -> None:
    """Copy each resident slot's tensor to its host copy (``write``), then free its device storage (0 bytes).

    The copies are queued on one side stream behind the current stream's work (the optimizer step that
    wrote the state), non-blocking into pinned memory, and the host waits once, for the last of them, not
    once per tensor: the host copies are what the optimizer's state entries read between steps
    (``park``), and the storage is freed only after its copy is done."""
    by_device: dict = {}
    for slot in slots:
        if slot.resident:
            by_device.setdefault(slot.tensor.device, []).append(slot)
    for device, resident in by_device.items():
        _evict_on(device, resident, write)


def _evict_on(device: torch.device, resident: list[HostSlot], write: bool) -> None:
    t0 = time.perf_counter()
    streams = resident[0]._device
    if write:
        if device not in _SIDE:
            _SIDE[device] = streams.Stream(device) if device.type != "cpu" else streams.Stream()
        side = _SIDE[device]
        side.wait_stream(streams.current_stream(device))
        with streams.stream(side):
            for slot in resident:
                slot.host.copy_(slot.tensor, non_blocking=device.type != "cpu")
            done = streams.Event()
            done.record(side)
        done.synchronize()  # the one host wait of the eviction
    for slot in resident:
        slot.tensor.untyped_storage().resize_(0)
        slot.resident = False
    STATS.add(bytes_written=sum(s.nbytes for s in resident) if write else 0, evict_s=time.perf_counter() - t0)
