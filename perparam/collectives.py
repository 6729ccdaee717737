"""Every collective perparam issues goes through this module, so it can be counted.

``CommCounter`` is a context manager that records each collective (kind, bytes, process group) issued
while it is active; tests use it to prove "one all-gather per group per unshard" and to compare the bytes
moved with the layout's prediction.

Byte convention (per rank): an all-gather records the bytes of the gathered output
(``K * input_bytes``), a reduce-scatter the bytes of its input (``K * output_bytes``), an all-reduce the
bytes of the tensor. A ring implementation sends ``(K - 1) / K`` of that figure from each rank.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import debug

# Process-wide, not per thread: on CUDA autograd runs backward hooks (and so the backward collectives) on
# its own device thread.
_counters: list[CommCounter] = []
_lock = threading.Lock()


@dataclass(frozen=True)
class CollectiveRecord:
    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce"
    nbytes: int  # see the module docstring for the convention
    group_size: int
    group_name: str
    dtype: torch.dtype


@dataclass
class CommCounter:
    """Records the collectives perparam issues in this process while active (any thread).

    Usage::

        with CommCounter() as comm:
            loss = model(x).sum(); loss.backward()
        comm.count("all_gather"), comm.bytes("reduce_scatter")
    """

    records: list[CollectiveRecord] = field(default_factory=list)

    def __enter__(self) -> CommCounter:
        with _lock:
            _counters.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with _lock:
            _counters.remove(self)

    def count(self, kind: str | None = None) -> int:
        return sum(1 for r in self.records if kind is None or r.kind == kind)

    def bytes(self, kind: str | None = None) -> int:
        return sum(r.nbytes for r in self.records if kind is None or r.kind == kind)

    def by_kind(self) -> dict[str, int]:
        return dict(Counter(r.kind for r in self.records))

    def clear(self) -> None:
        self.records.clear()


def _record(kind: str, nbytes: int, group: dist.ProcessGroup, dtype: torch.dtype) -> None:
    if not _counters:
        return
    rec = CollectiveRecord(kind, nbytes, group.size(), group.group_name, dtype)
    with _lock:
        for c in _counters:
            c.records.append(rec)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False,
               what: str = ""):
    """Gather ``input`` (``[n]``) from every rank of ``group`` into ``output`` (``[K * n]``), rank-major.
    ``what`` names the group and parameters (checked across ranks in debug mode, ``perparam.debug``)."""
    if debug.debug_enabled():
        debug.check("all_gather", input, output.numel() * output.element_size(), group, what)
    _record("all_gather", output.numel() * output.element_size(), group, output.dtype)
    if group.size() == 1:
        output.copy_(input)
        return None
    return dist.all_gather_single(output, input, group=group, async_op=async_op)


# How a reduce-scatter runs on gloo: "all_to_all" (each rank receives the K pieces of its own chunk and
# sums them locally) or "native" (``dist.reduce_scatter_single``, which gloo builds from an all-reduce of the
# whole input). Same bytes in CommCounter's convention; measured on the benchmark model (2 ranks, 12.6 MB
# fp32 input): CPU per call 15 -> 6 ms (benchmarks/README.md). Module-level so benchmarks can compare.
GLOO_REDUCE_SCATTER = "all_to_all"


class _SumAfterAllToAll:
    """A work handle: once the all-to-all has delivered the ``[K, n]`` pieces of this rank's chunk, sum
    them (in rank order; 16-bit dtypes rounded once for K = 2, accumulated in fp32 by ``torch.sum`` for
    more) into the reduce-scatter's output."""

    def __init__(self, work, pieces: torch.Tensor, output: torch.Tensor) -> None:
        self.work, self.pieces, self.output = work, pieces, output

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
            self.work = None
            if self.pieces.shape[0] == 2:  # one add: 1.0 vs 1.4 ms for torch.sum on 6 MB (one core)
                torch.add(self.pieces[0], self.pieces[1], out=self.output)
            else:
                torch.sum(self.pieces, dim=0, out=self.output)
            self.pieces = None
        return True


def reduce_scatter_sum(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup,
                       async_op: bool = False, what: str = "", scratch: torch.Tensor | None = None):
    """Sum ``input`` (``[K * n]``) over ``group`` and leave this rank's ``[n]`` piece in ``output``.

    On gloo (``GLOO_REDUCE_SCATTER``) an all-to-all of the same bytes then a local sum (at ``wait()``)
    into ``output``; the ``[K, n]`` pieces are received into ``scratch`` (a uint8 tensor of ``input``'s
    bytes, in use until ``wait()`` returns) or a fresh buffer."""
    if debug.debug_enabled():
        debug.check("reduce_scatter", input, output.numel() * output.element_size(), group, what)
    _record("reduce_scatter", input.numel() * input.element_size(), group, input.dtype)
    if group.size() == 1:
        output.copy_(input)
        return None
    if GLOO_REDUCE_SCATTER == "all_to_all" and input.device.type == "cpu" and dist.get_backend(group) == "gloo":
        nbytes = input.numel() * input.element_size()
        raw = scratch[:nbytes] if scratch is not None else torch.empty(nbytes, dtype=torch.uint8, device=input.device)
        # as bytes: gloo's all-to-all then takes any dtype
        work = dist.all_to_all_single(raw, input.view(torch.uint8), group=group, async_op=True)
        handle = _SumAfterAllToAll(work, raw.view(input.dtype).view(group.size(), -1), output)
        if not async_op:
            handle.wait()
            return None
        return handle
    return dist.reduce_scatter_single(output, input, group=group, async_op=async_op)


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False, what: str = ""):
    """Sum ``tensor`` in place over ``group``."""
    if debug.debug_enabled():
        debug.check("all_reduce", tensor, tensor.numel() * tensor.element_size(), group, what)
    _record("all_reduce", tensor.numel() * tensor.element_size(), group, tensor.dtype)
    if group.size() == 1:
        return None
    return dist.all_reduce(tensor, group=group, async_op=async_op)
