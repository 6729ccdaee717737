"""``CommCounter``: the record of every collective perparam issues (kind, bytes, process group, dtype),
and what the issuing modules (``collectives``, ``point_to_point``) share: ``GatheredRows`` and the pool
helper. Byte convention in ``perparam.comm.collectives``' docstring."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# Process-wide, not per thread: on CUDA autograd runs backward hooks (and so the backward collectives) on
# its own device thread.
_counters: list[CommCounter] = []
_lock = threading.Lock()


@dataclass(frozen=True)
class CollectiveRecord:
    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce" | "all_to_all"
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


def record_collective(kind: str, nbytes: int, group: dist.ProcessGroup, dtype: torch.dtype) -> None:
    """One logical collective of ``kind`` moving ``nbytes`` bytes of ``dtype`` over ``group``, recorded by
    every ``CommCounter`` open now (none open: nothing is done)."""
    if not _counters:
        return
    rec = CollectiveRecord(kind, nbytes, group.size(), group.group_name, dtype)
    with _lock:
        for c in _counters:
            c.records.append(rec)


def take_buffer(pool, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 ``[nbytes]`` buffer on ``device``: from ``pool`` (a ``BufferPool``), or a new one without
    it."""
    return pool.take(nbytes, device) if pool is not None else torch.empty(nbytes, dtype=torch.uint8,
                                                                          device=device)


class GatheredRows:
    """An all-gather of one uint8 row (``[slot]``) per rank, in flight or done. After ``wait()``,
    ``segments`` lists ``(first_rank, rows)`` pairs, ``rows`` a ``[m, slot]`` tensor holding the rows of
    ranks ``first_rank .. first_rank + m - 1``; together they cover every rank once, in rank order.
    ``buffers`` are the receive buffers taken from the pool (give them back after reading the rows)."""

    def __init__(self, work, segments: list[tuple[int, torch.Tensor]], buffers: list[torch.Tensor]) -> None:
        self.work, self.segments, self.buffers = work, segments, buffers

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
