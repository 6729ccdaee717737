"""Every collective perparam issues goes through this module, so it can be counted.

``CommCounter`` is a context manager that records each collective (kind, bytes, process group) issued
while it is active; tests use it to prove "one all-gather per group per unshard" and to compare the bytes
moved with the layout's prediction.

Byte convention (per rank): an all-gather records the bytes of the gathered output
(``K * input_bytes``), a reduce-scatter the bytes of its input (``K * output_bytes``), an all-reduce the
bytes of the tensor. A ring implementation sends ``(K - 1) / K`` of that figure from each rank. An
all-to-all (``exchange_uneven``: the owner path of whole-matrix optimizers) records the bytes this rank
sends to *other* ranks, so the records summed over the ranks are the bytes on the wire.
"""

from __future__ import annotations

import os
import queue
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import c10d, debug

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


def _record(kind: str, nbytes: int, group: dist.ProcessGroup, dtype: torch.dtype) -> None:
    if not _counters:
        return
    rec = CollectiveRecord(kind, nbytes, group.size(), group.group_name, dtype)
    with _lock:
        for c in _counters:
            c.records.append(rec)


# How an all-gather of rows runs on gloo (``gloo``): "all_to_all" (one all-to-all in which each rank sends its
# row to every other rank and receives theirs into a buffer of K - 1 rows; its own row is never copied) or
# "native" (c10d's all-gather into one tensor, which gloo runs through a flat buffer it allocates on every
# call and copies out afterwards). Same bytes on the wire. Measured on 2 ranks, one 12.6 MB gather of the
# benchmark model (benchmarks/README.md): CPU per call 5.2-9.0 ms native, 2.7-3.3 ms all-to-all. The
# runtime passes ``perparam.configure(gloo_all_gather=...)``.


def _take(pool, nbytes: int, device: torch.device) -> torch.Tensor:
    return pool.take(nbytes, device) if pool is not None else torch.empty(nbytes, dtype=torch.uint8, device=device)


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


def all_gather_rows(send: torch.Tensor, group: dist.ProcessGroup, pool=None, async_op: bool = True,
                    what: str = "", gloo: str = "all_to_all", comm=None) -> GatheredRows:
    """All-gather ``send`` (uint8 ``[slot]``, this rank's row) over ``group``: one collective, recorded as
    an all-gather of ``K * slot`` bytes. ``send`` must stay untouched until the rows have been read
    (on gloo it *is* this rank's row). Receive buffers come from ``pool`` (a ``BufferPool``) when given.

    On gloo (``gloo="all_to_all"``, the default) an all-to-all with split sizes: ``send`` goes to every other rank (for
    K > 2 from K - 1 copies of it), the other ranks' rows arrive in one ``[K - 1, slot]`` buffer. Elsewhere
    c10d's all-gather into one tensor (``perparam.comm.c10d``) into a ``[K, slot]`` buffer. ``comm``: a custom
    all-gather with FSDP2's ``AllGather`` interface (``set_custom_all_gather``): its ``allocate`` gives the
    ``[K * slot]`` uint8 output and ``comm(output, send, group, async_op=True)`` fills it."""
    k, slot = group.size(), send.numel()
    if debug.debug_enabled():
        debug.check("all_gather", send, k * slot, group, what)
    _record("all_gather", k * slot, group, send.dtype)
    if k == 1:
        return GatheredRows(None, [(0, send.view(1, slot))], [])
    if comm is not None:
        recv = comm.allocate((k * slot,), dtype=torch.uint8, device=send.device)
        work = comm(recv, send, group, async_op=True)
        result = GatheredRows(work, [(0, recv.view(k, slot))], [])
    elif gloo in ("all_to_all", "zero_copy") and send.device.type == "cpu" and dist.get_backend(group) == "gloo":
        me = group.rank()
        others = _take(pool, (k - 1) * slot, send.device)
        buffers = [others]
        if k == 2:
            source = send
        else:  # one copy of the row per destination
            source = _take(pool, (k - 1) * slot, send.device)
            source.view(k - 1, slot).copy_(send.expand(k - 1, slot))
            buffers.append(source)
        splits = [0 if r == me else slot for r in range(k)]
        work = dist.all_to_all_single(others, source, splits, splits, group=group, async_op=True)
        rows = others.view(k - 1, slot)
        segments = [(0, rows[:me]), (me, send.view(1, slot)), (me + 1, rows[me:])]
        result = GatheredRows(work, [(r, t) for r, t in segments if t.shape[0]], buffers)
    else:
        recv = _take(pool, k * slot, send.device)
        work = c10d.all_gather_into(recv, send, group, async_op=True)
        result = GatheredRows(work, [(0, recv.view(k, slot))], [recv])
    if not async_op:
        result.wait()
    return result


def _post_rotation(group: dist.ProcessGroup, count: int, send_of: Callable[[int, int], torch.Tensor],
                   recv_of: Callable[[int, int], torch.Tensor]) -> list:
    """Post the point-to-point half of a zero-copy collective over ``count`` tensors; return the works.

    Peers in a rotation (for shift 1 .. K-1: send to ``me + shift``, receive from ``me - shift``, so no pair
    of ranks waits on a third), then tensors in order; per (peer, tensor ``tag``) first the send of
    ``send_of(tag, dst)``, then the receive into ``recv_of(tag, src)``, each skipped when empty (the peer
    skips its counterpart: sizes agree across ranks). Every rank posts in this order, which is what pairs
    gloo's same-tag messages (matched in posting order)."""
    k, me = group.size(), group.rank()
    works = []
    for shift in range(1, k):
        dst, src = (me + shift) % k, (me - shift) % k
        for tag in range(count):
            out = send_of(tag, dst)
            if out.numel():
                works.append(group.send([out], dst, tag))
            into = recv_of(tag, src)
            if into.numel():
                works.append(group.recv([into], src, tag))
    return works


class _PointToPoint:
    """A work handle over the sends and receives of one in-place all-gather (``all_gather_in_place``)."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []


def all_gather_in_place(regions: list[list[torch.Tensor]], group: dist.ProcessGroup, slot_bytes: int,
                        what: str = "", async_op: bool = True) -> GatheredRows:
    """All-gather each tensor's K rank pieces straight into their places, without staging buffers: the
    zero-copy all-gather of ``perparam.configure(gloo_all_gather="zero_copy")`` (gloo on CPU).

    ``regions[i][r]``: where rank ``r``'s piece of tensor ``i`` lives on this rank, a contiguous tensor
    (the same numel and dtype on every rank; empty where rank ``r`` holds nothing). This rank's own pieces
    (``regions[i][group.rank()]``) must already be filled; they are sent to every other rank and the
    others' pieces received in place: per tensor and peer one send and one receive (point-to-point, tag
    ``i``; gloo matches messages of one tag in the order both ranks post them, and every rank posts the
    same gathers in the same order). Recorded as one all-gather of ``K * slot_bytes`` bytes (the group's
    packed layout, ``GroupLayout.all_gather_bytes``; the wire carries the unpadded pieces). Returns a
    ``GatheredRows`` with no segments (nothing to copy out) and no buffers."""
    k, me = group.size(), group.rank()
    if debug.debug_enabled():
        debug.check("all_gather", torch.empty((), dtype=torch.uint8).expand(slot_bytes), k * slot_bytes, group,
                    what)
    _record("all_gather", k * slot_bytes, group, torch.uint8)
    works = _post_rotation(group, len(regions), lambda tag, dst: regions[tag][me],
                           lambda tag, src: regions[tag][src])
    result = GatheredRows(_PointToPoint(works), None, [])
    if not async_op:
        result.wait()
    return result


# How a reduce-scatter runs on gloo (``gloo``): "all_to_all" (each rank receives the K pieces of its own chunk
# and sums them locally) or "native" (c10d's reduce-scatter into one tensor, which gloo builds from an all-reduce of
# the whole input). Same bytes in CommCounter's convention; measured on the benchmark model (2 ranks, 12.6 MB
# fp32 input): CPU per call 15 -> 6 ms (benchmarks/README.md). The runtime passes
# ``perparam.configure(gloo_reduce_scatter=...)``, so benchmarks can compare.


class _SumAfterAllToAll:
    """A work handle: once the all-to-all has delivered the other ranks' pieces of this rank's chunk, sum
    them with this rank's own piece, in rank order (16-bit dtypes rounded once for K = 2, accumulated in
    fp32 by ``torch.sum`` for more), into the reduce-scatter's output; then give the receive buffer (if
    any: for K = 2 the peer's piece arrives in the output itself) back to the pool."""

    def __init__(self, work, pieces: list[torch.Tensor], output: torch.Tensor, raw: torch.Tensor | None,
                 pool) -> None:
        self.work, self.pieces, self.output, self.raw, self.pool = work, pieces, output, raw, pool

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
            self.work = None
            if len(self.pieces) == 2:  # one add: 1.0 vs 1.4 ms for torch.sum on 6 MB (one core)
                torch.add(self.pieces[0], self.pieces[1], out=self.output)
            else:
                torch.sum(self.pieces[0], dim=0, out=self.output)
            self.pieces = None
            if self.pool is not None and self.raw is not None:
                self.pool.give_back(self.raw)
            self.raw = None
        return True


def reduce_scatter_sum(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup,
                       async_op: bool = False, what: str = "", pool=None, gloo: str = "all_to_all",
                       comm=None):
    """Sum ``input`` (``[K * n]``) over ``group`` and leave this rank's ``[n]`` piece in ``output``.

    On gloo (``gloo="all_to_all"``, the default) an all-to-all of the same bytes then a local sum (at ``wait()``)
    into ``output``. For K = 2 each rank sends only the other rank's piece, receives its peer's piece of
    its own chunk straight into ``output`` and adds its own piece there (no buffer, no copy of its own
    piece); for K > 2 the ``[K, n]`` pieces, its own included, arrive in one buffer (from ``pool``, a
    ``BufferPool``, when given; back to it at ``wait()``) and are summed in rank order. ``input`` must stay
    untouched until ``wait()``. ``comm``: a custom reduce-scatter with FSDP2's ``ReduceScatter`` interface
    (``set_custom_reduce_scatter``), called as ``comm(output, input, group, op=SUM, async_op=...)``."""
    if debug.debug_enabled():
        debug.check("reduce_scatter", input, output.numel() * output.element_size(), group, what)
    _record("reduce_scatter", input.numel() * input.element_size(), group, input.dtype)
    k = group.size()
    if k == 1:
        output.copy_(input)
        return None
    if comm is not None:
        return comm(output, input, group, op=dist.ReduceOp.SUM, async_op=async_op)
    # "zero_copy" names the runtime's per-parameter reduce-scatter (``reduce_scatter_in_place``); a packed
    # input handed here under it runs as the all-to-all
    if gloo in ("all_to_all", "zero_copy") and input.device.type == "cpu" and dist.get_backend(group) == "gloo":
        rows = input.view(k, -1)
        row_bytes = rows.shape[1] * input.element_size()
        if k == 2:
            me = group.rank()
            # the other rank's piece of this rank's chunk arrives in `output` (or a scratch tensor if `output`
            # cannot take it as bytes); its own piece is added at wait() (a + b == b + a exactly)
            into = output if output.is_contiguous() and output.dtype == input.dtype else rows[me].new_empty(rows.shape[1])
            splits = [0 if r == me else row_bytes for r in range(k)]
            # as bytes: gloo's all-to-all then takes any dtype
            work = dist.all_to_all_single(into.view(torch.uint8), rows[1 - me].view(torch.uint8), splits, splits,
                                          group=group, async_op=True)
            handle = _SumAfterAllToAll(work, [into, rows[me]], output, None, None)
        else:
            raw = _take(pool, k * row_bytes, input.device)
            work = dist.all_to_all_single(raw, input.view(torch.uint8), group=group, async_op=True)
            handle = _SumAfterAllToAll(work, [raw.view(input.dtype).view(k, -1)], output, raw, pool)
        if not async_op:
            handle.wait()
            return None
        return handle
    return c10d.reduce_scatter_into(output, input, group, async_op=async_op)


class _Waiter:
    """A daemon thread that waits on the point-to-point works of one process group, in the order given
    (``ProcessGroupGloo``'s send and receive works report ``is_completed()`` only once waited on), so a
    reduction in flight can be polled without blocking (``_SumAfterPointToPoint.is_completed``). One per
    process group: ranks that run as threads of one process each have theirs, so one rank's wait never
    holds up another's."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="perparam-p2p-waiter", daemon=True).start()

    def watch(self, works: list, done: threading.Event, errors: list) -> None:
        self.queue.put((works, done, errors))

    def retire(self) -> None:
        """Let the thread end once it has waited on what it was given (its process group is gone)."""
        self.queue.put(None)

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            works, done, errors = item
            for work in works:
                try:
                    work.wait()
                except Exception as e:  # re-raised by the owner's wait()
                    errors.append(e)
            done.set()
            # hold no work while idle: a gloo send/recv work alive in this frame when the process group is
            # destroyed aborts the process at exit ("terminate called without an active exception")
            item = works = work = None


_waiters: dict[tuple[int, int], _Waiter] = {}  # (pid, id(process group)): a forked child starts its own


def _waiter(group: dist.ProcessGroup) -> _Waiter:
    key = (os.getpid(), id(group))
    with _lock:
        waiter = _waiters.get(key)
        if waiter is None:
            waiter = _waiters[key] = _Waiter()
            # a process group destroyed and collected (``destroy_process_group()``, then a new world) takes
            # its thread with it: one thread per live group, however often a process makes new ones
            weakref.finalize(group, _retire, key)
    return waiter


def _retire(key: tuple[int, int]) -> None:
    waiter = _waiters.pop(key, None)  # no lock: the collector may run this while this thread holds it
    if waiter is not None:
        waiter.retire()


class _SumAfterPointToPoint:
    """A work handle over the sends and receives of one in-place reduce-scatter
    (``reduce_scatter_in_place``): once they have finished, sum this rank's own pieces with the received
    ones into the output (K = 2: one foreach add; K > 2: ``torch.sum`` over the ``[K, n]`` staging buffer,
    then the buffer goes back to the pool). Keeps the sent tensors alive until then."""

    def __init__(self, works: list, finish, keep: list, group: dist.ProcessGroup) -> None:
        self.done, self.errors = threading.Event(), []
        self.finish, self.keep = finish, keep
        if works:
            _waiter(group).watch(works, self.done, self.errors)
        else:
            self.done.set()

    def is_completed(self) -> bool:
        return self.finish is None or self.done.is_set()

    def wait(self) -> bool:
        if self.finish is None:
            return True
        self.done.wait()
        if self.errors:
            raise self.errors[0]
        self.finish()
        self.finish = self.keep = None
        return True


def zero_gaps(offsets: Sequence[int], numels: Sequence[int], n: int) -> list[tuple[int, int]]:
    """The runs ``(start, length)`` of ``[0, n)`` that no piece covers (piece ``i``: ``numels[i]`` elements
    at ``offsets[i]``), in order: the padding ``reduce_scatter_in_place`` zeroes in its output."""
    gaps, cursor = [], 0
    for off, numel in sorted(zip(offsets, numels), key=lambda t: t[0]):
        if off > cursor:
            gaps.append((cursor, off - cursor))
        cursor = max(cursor, off + numel)
    if cursor < n:
        gaps.append((cursor, n - cursor))
    return gaps


def reduce_scatter_in_place(pieces: list[list[torch.Tensor]], output: torch.Tensor, offsets: list[int],
                            group: dist.ProcessGroup, what: str = "", pool=None, async_op: bool = True,
                            gaps: Sequence[tuple[int, int]] | None = None):
    """Reduce-scatter tensors given as their K rank pieces, without packing them: the zero-copy
    reduce-scatter of ``perparam.configure(gloo_reduce_scatter="zero_copy")`` (gloo on CPU, K > 1).

    ``pieces[i][r]``: this rank's contribution to rank ``r``'s piece of tensor ``i``, a contiguous tensor
    of ``output``'s dtype (the same numel on every rank; empty where rank ``r`` holds nothing), e.g. rows r
    of a ``Shard(0)`` gradient. After ``wait()``, ``output`` (``[n]``) holds at ``offsets[i]`` the sum over
    the ranks of tensor ``i``'s piece of this rank (``pieces[i][me].numel()`` elements) and zeros everywhere
    else (the padding of the packed reduce-scatter's output, ``reduce_scatter_offsets``): the values
    ``reduce_scatter_sum`` leaves for the packed input, bit for bit (K = 2: ``peer + own``; K > 2:
    ``torch.sum`` over the K pieces in rank order, in a ``[K, n]`` buffer from ``pool``).

    Per tensor and peer one send of this rank's piece for the peer, straight from ``pieces``, and one
    receive of the peer's piece of this rank's chunk (K = 2: into ``output``; K > 2: into the buffer);
    point-to-point with tag ``i``, peers in a rotation, in the same order on every rank (gloo pairs
    same-tag messages in posting order). Recorded as one reduce-scatter of ``K * n`` elements, the packed
    reduce-scatter's figure. ``pieces`` must stay untouched until ``wait()``. ``gaps``: ``zero_gaps`` of the
    offsets and this rank's piece sizes, when the caller keeps it (computed here when ``None``)."""
    k, me = group.size(), group.rank()
    dtype, device = output.dtype, output.device
    if debug.debug_enabled():
        debug.check("reduce_scatter", torch.empty((), dtype=dtype, device=device).expand(k * output.numel()),
                    output.numel() * output.element_size(), group, what)
    _record("reduce_scatter", k * output.numel() * output.element_size(), group, dtype)
    n = output.numel()
    own = [p[me] for p in pieces]
    # the gaps of ``output`` (padding) between the pieces are zeros, as a sum of zero padding would be
    if gaps is None:
        gaps = zero_gaps(offsets, [piece.numel() for piece in own], n)
    raw = None
    if k == 2:
        into = [output.narrow(0, off, piece.numel()) for off, piece in zip(offsets, own)]
        zero = [output.narrow(0, a, m) for a, m in gaps]
    else:
        raw = _take(pool, k * n * output.element_size(), device)
        rows = raw.view(dtype).view(k, n)
        slots = [[rows[r].narrow(0, off, piece.numel()) for r in range(k)] for off, piece in zip(offsets, own)]
        into = [s[me] for s in slots]
        zero = [rows[r].narrow(0, a, m) for r in range(k) for a, m in gaps]
        pairs = [(d, s) for d, s in zip(into, own) if s.numel()]
        if pairs:
            torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
    zero = [z for z in zero if z.numel()]
    if zero:
        torch._foreach_zero_(zero)
    # the receive target has own[tag]'s numel: skipped exactly where this rank holds nothing of tensor tag
    works = _post_rotation(group, len(pieces), lambda tag, dst: pieces[tag][dst],
                           lambda tag, src: into[tag] if k == 2 else slots[tag][src])

    def finish() -> None:
        if k == 2:
            pairs = [(d, s) for d, s in zip(into, own) if s.numel()]
            if pairs:  # peer + own, as reduce_scatter_sum's one add (a + b == b + a exactly)
                torch._foreach_add_([d for d, _ in pairs], [s for _, s in pairs])
        else:
            torch.sum(rows, dim=0, out=output)
            if pool is not None:
                pool.give_back(raw)

    handle = _SumAfterPointToPoint(works, finish, [pieces], group)
    if not async_op:
        handle.wait()
        return None
    return handle


def exchange_rows(send: torch.Tensor, group: dist.ProcessGroup, pool=None, what: str = "",
                  dtype: torch.dtype = torch.uint8):
    """The wire of a low-precision reduce-scatter (``perparam.runtime.grad_quant``): row r of ``send``
    (uint8 ``[K, row]``, encoded gradient pieces) goes to rank r; returns ``(work, recv)``, ``recv`` a uint8
    ``[K, row]`` buffer (from ``pool`` when given: give it back after decoding) whose row r came from rank r
    once ``work`` (``None`` for K = 1) has finished. The caller decodes and sums. One all-to-all, recorded
    as a reduce-scatter of ``K * row`` bytes whose ``dtype`` is the codes' (e.g. ``torch.int8``)."""
    k, row = send.shape
    if debug.debug_enabled():
        debug.check("reduce_scatter", send, row, group, what)
    _record("reduce_scatter", k * row, group, dtype)
    if group.size() == 1:
        return None, send
    recv = _take(pool, k * row, send.device).view(k, row)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    return work, recv


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False, what: str = ""):
    """Sum ``tensor`` in place over ``group``."""
    if debug.debug_enabled():
        debug.check("all_reduce", tensor, tensor.numel() * tensor.element_size(), group, what)
    _record("all_reduce", tensor.numel() * tensor.element_size(), group, tensor.dtype)
    if group.size() == 1:
        return None
    return dist.all_reduce(tensor, group=group, async_op=async_op)


def exchange_uneven(send: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                    group: dist.ProcessGroup, logical_bytes: int, what: str = "", async_op: bool = True):
    """One all-to-all of uneven pieces over ``group`` (``perparam.runtime.owner_step``): elements
    ``send_splits[r]`` of ``send`` (1-D, in rank order) go to rank r, ``recv_splits[r]`` elements arrive
    from rank r. Returns ``(work, recv)``: ``recv`` a new 1-D tensor of ``sum(recv_splits)`` elements of
    ``send``'s dtype, valid once ``work`` (``None`` for K = 1) is waited on. Recorded as an
    ``"all_to_all"`` of the bytes sent to the other ranks; ``logical_bytes`` (the same on every rank: the
    bucket's whole bytes) is what the debug mode compares, since the pieces differ per rank."""
    k, me = group.size(), group.rank()
    if debug.debug_enabled():
        debug.check("all_to_all", send[:0], logical_bytes, group, what)
    item = send.element_size()
    _record("all_to_all", (sum(send_splits) - send_splits[me]) * item, group, send.dtype)
    if k == 1:
        return None, send
    recv = torch.empty(sum(recv_splits), dtype=send.dtype, device=send.device)
    work = dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group, async_op=async_op)
    return (work if async_op else None), recv


def all_gather_objects(obj, group: dist.ProcessGroup) -> list:
    """Every rank's picklable ``obj`` over ``group``, in rank order (``dist.all_gather_object``): for small
    metadata outside the training step (a checkpoint's owner-state descriptions). Not recorded."""
    if group.size() == 1:
        return [obj]
    out: list = [None] * group.size()
    dist.all_gather_object(out, obj, group=group)
    return out
