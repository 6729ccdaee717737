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

import torch
import torch.distributed as dist

from ..sharding.layout import ceil_div
from ..sharding.tree_sum import tree_sum
from . import c10d, debug, sequence
from .counter import CollectiveRecord, CommCounter, GatheredRows, record_collective, take_buffer
from .point_to_point import all_gather_in_place, reduce_scatter_in_place, zero_gaps

__all__ = ["CollectiveRecord", "CommCounter", "GatheredRows", "all_gather_in_place", "all_gather_objects",
           "all_gather_rows", "all_reduce_sum", "exchange_rows", "exchange_uneven", "reduce_scatter_in_place",
           "reduce_scatter_sum", "reduce_to_owners", "tree_all_reduce_sum", "zero_gaps"]

# How an all-gather of rows runs on gloo (``gloo``): "all_to_all" (one all-to-all in which each rank sends its
# row to every other rank and receives theirs into a buffer of K - 1 rows; its own row is never copied) or
# "native" (c10d's all-gather into one tensor, which gloo runs through a flat buffer it allocates on every
# call and copies out afterwards). Same bytes on the wire; the all-to-all costs less CPU per call
# (``step_time`` in benchmarks/README.md, "The gloo collectives and the buffer pool"). The runtime passes
# ``perparam.configure(gloo_all_gather=...)``.


def all_gather_rows(send: torch.Tensor, group: dist.ProcessGroup, pool=None, async_op: bool = True,
                    what: str = "", gloo: str = "all_to_all", comm=None) -> GatheredRows:
    """All-gather ``send`` (uint8 ``[slot]``, this rank's row) over ``group``: one collective, recorded as
    an all-gather of ``K * slot`` bytes. ``send`` must stay untouched until the rows have been read
    (on gloo it *is* this rank's row). Receive buffers come from ``pool`` (a ``BufferPool``) when given.

    On gloo (``gloo="all_to_all"``, the default) an all-to-all with split sizes: ``send`` goes to every other
    rank (for K > 2 from K - 1 copies of it), the other ranks' rows arrive in one ``[K - 1, slot]`` buffer.
    Elsewhere c10d's all-gather into one tensor (``perparam.comm.c10d``) into a ``[K, slot]`` buffer.
    ``comm``: a custom all-gather with FSDP2's ``AllGather`` interface (``set_custom_all_gather``): its
    ``allocate`` gives the ``[K * slot]`` uint8 output and ``comm(output, send, group, async_op=True)`` fills
    it."""
    k, slot = group.size(), send.numel()
    if debug.debug_enabled():
        debug.check("all_gather", send, k * slot, group, what)
    elif k > 1:
        sequence.expect("all_gather", slot, k * slot, group, what)
    record_collective("all_gather", k * slot, group, send.dtype)
    if k == 1:
        return GatheredRows(None, [(0, send.view(1, slot))], [])
    if comm is not None:
        recv = comm.allocate((k * slot,), dtype=torch.uint8, device=send.device)
        work = comm(recv, send, group, async_op=True)
        result = GatheredRows(work, [(0, recv.view(k, slot))], [])
    elif (gloo in ("all_to_all", "zero_copy") and send.device.type == "cpu"
          and dist.get_backend(group) == "gloo"):
        me = group.rank()
        others = take_buffer(pool, (k - 1) * slot, send.device)
        buffers = [others]
        if k == 2:
            source = send
        else:  # one copy of the row per destination
            source = take_buffer(pool, (k - 1) * slot, send.device)
            source.view(k - 1, slot).copy_(send.expand(k - 1, slot))
            buffers.append(source)
        splits = [0 if r == me else slot for r in range(k)]
        work = dist.all_to_all_single(others, source, splits, splits, group=group, async_op=True)
        rows = others.view(k - 1, slot)
        segments = [(0, rows[:me]), (me, send.view(1, slot)), (me + 1, rows[me:])]
        result = GatheredRows(work, [(r, t) for r, t in segments if t.shape[0]], buffers)
    else:
        recv = take_buffer(pool, k * slot, send.device)
        work = c10d.all_gather_into(recv, send, group, async_op=True)
        result = GatheredRows(work, [(0, recv.view(k, slot))], [recv])
    if not async_op:
        result.wait()
    return result


# How a reduce-scatter runs on gloo (``gloo``): "all_to_all" (each rank receives the K pieces of its own chunk
# and sums them locally) or "native" (c10d's reduce-scatter into one tensor, which gloo builds from an
# all-reduce of the whole input). Same bytes in CommCounter's convention; the all-to-all costs less CPU per
# call (``reduce_step`` in benchmarks/README.md). The runtime passes
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

    On gloo (``gloo="all_to_all"``, the default) an all-to-all of the same bytes then a local sum (at
    ``wait()``) into ``output``. For K = 2 each rank sends only the other rank's piece, receives its peer's
    piece of its own chunk straight into ``output`` and adds its own piece there (no buffer, no copy of its
    own piece); for K > 2 the ``[K, n]`` pieces, its own included, arrive in one buffer (from ``pool``, a
    ``BufferPool``, when given; back to it at ``wait()``) and are summed in rank order. ``input`` must stay
    untouched until ``wait()``. ``comm``: a custom reduce-scatter with FSDP2's ``ReduceScatter`` interface
    (``set_custom_reduce_scatter``), called as ``comm(output, input, group, op=SUM, async_op=...)``."""
    if debug.debug_enabled():
        debug.check("reduce_scatter", input, output.numel() * output.element_size(), group, what)
    record_collective("reduce_scatter", input.numel() * input.element_size(), group, input.dtype)
    k = group.size()
    if k == 1:
        output.copy_(input)
        return None
    if comm is not None:
        return comm(output, input, group, op=dist.ReduceOp.SUM, async_op=async_op)
    # "zero_copy" names the runtime's per-parameter reduce-scatter (``reduce_scatter_in_place``); a packed
    # input handed here under it runs as the all-to-all
    if (gloo in ("all_to_all", "zero_copy") and input.device.type == "cpu"
        and dist.get_backend(group) == "gloo"):
        rows = input.view(k, -1)
        row_bytes = rows.shape[1] * input.element_size()
        if k == 2:
            me = group.rank()
            # the other rank's piece of this rank's chunk arrives in `output` (or a scratch tensor if `output`
            # cannot take it as bytes); its own piece is added at wait() (a + b == b + a exactly)
            into = (output if output.is_contiguous() and output.dtype == input.dtype
                    else rows[me].new_empty(rows.shape[1]))
            splits = [0 if r == me else row_bytes for r in range(k)]
            # as bytes: gloo's all-to-all then takes any dtype
            work = dist.all_to_all_single(into.view(torch.uint8), rows[1 - me].view(torch.uint8), splits,
                                          splits, group=group, async_op=True)
            handle = _SumAfterAllToAll(work, [into, rows[me]], output, None, None)
        else:
            raw = take_buffer(pool, k * row_bytes, input.device)
            work = dist.all_to_all_single(raw, input.view(torch.uint8), group=group, async_op=True)
            handle = _SumAfterAllToAll(work, [raw.view(input.dtype).view(k, -1)], output, raw, pool)
        if not async_op:
            handle.wait()
            return None
        return handle
    return c10d.reduce_scatter_into(output, input, group, async_op=async_op)


def exchange_rows(send: torch.Tensor, group: dist.ProcessGroup, pool=None, what: str = "",
                  dtype: torch.dtype = torch.uint8):
    """The wire of a low-precision reduce-scatter (``perparam.runtime.paths.reduce_qgz``): row r of ``send``
    (uint8 ``[K, row]``, encoded gradient pieces) goes to rank r; returns ``(work, recv)``, ``recv`` a uint8
    ``[K, row]`` buffer (from ``pool`` when given: give it back after decoding) whose row r came from rank r
    once ``work`` (``None`` for K = 1) has finished. The caller decodes and sums. One all-to-all, recorded
    as a reduce-scatter of ``K * row`` bytes whose ``dtype`` is the codes' (e.g. ``torch.int8``)."""
    k, row = send.shape
    if debug.debug_enabled():
        debug.check("reduce_scatter", send, row, group, what)
    record_collective("reduce_scatter", k * row, group, dtype)
    if group.size() == 1:
        return None, send
    recv = take_buffer(pool, k * row, send.device).view(k, row)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    return work, recv


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False, what: str = ""):
    """Sum ``tensor`` in place over ``group``."""
    if debug.debug_enabled():
        debug.check("all_reduce", tensor, tensor.numel() * tensor.element_size(), group, what)
    record_collective("all_reduce", tensor.numel() * tensor.element_size(), group, tensor.dtype)
    if group.size() == 1:
        return None
    return dist.all_reduce(tensor, group=group, async_op=async_op)


def tree_all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup, what: str = "") -> torch.Tensor:
    """``tensor`` (``[n]``, every rank's of one size and dtype) summed over ``group`` in rank-tree order:
    the K ranks' tensors added pairwise, level by level (``sharding.tree_sum``, K a power of two), the same
    bits on every rank. A reduce-scatter then an all-gather, the bytes of a ring all-reduce: ``[K, n/K]``
    pieces exchanged (``exchange_rows``, recorded as a reduce-scatter), each rank's piece tree-summed, the
    K sums all-gathered (``all_gather_rows``). Returns a new ``[n]`` tensor (``tensor`` itself for K = 1).
    Synchronous (the K-invariant mode, ``perparam.invariant``, reduces once per step)."""
    k, n = group.size(), tensor.numel()
    if k == 1:
        return tensor
    cols, item = ceil_div(n, k), tensor.element_size()
    send = tensor.new_zeros(k * cols)
    send[:n].copy_(tensor.reshape(-1))
    work, rows = exchange_rows(send.view(torch.uint8).view(k, cols * item), group, what=what,
                               dtype=tensor.dtype)
    if work is not None:
        work.wait()
    pieces = rows.view(tensor.dtype).view(k, cols)
    mine = tree_sum([pieces[r] for r in range(k)])
    gathered = all_gather_rows(mine.view(torch.uint8), group, async_op=False, what=what)
    out = torch.empty(k, cols * item, dtype=torch.uint8, device=tensor.device)
    for first, seg in gathered.segments:
        out[first:first + seg.shape[0]].copy_(seg)
    return out.view(tensor.dtype).view(-1)[:n]


def exchange_uneven(send: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                    group: dist.ProcessGroup, logical_bytes: int, what: str = "", async_op: bool = True,
                    recv: torch.Tensor | None = None):
    """One all-to-all of uneven pieces over ``group`` (``perparam.runtime.owner_step``): elements
    ``send_splits[r]`` of ``send`` (1-D, in rank order) go to rank r, ``recv_splits[r]`` elements arrive
    from rank r. Returns ``(work, recv)``: ``recv`` (given: a 1-D tensor of ``sum(recv_splits)`` elements of
    ``send``'s dtype; else a new one) valid once ``work`` (``None`` for K = 1: ``send`` itself) is waited on.
    Recorded as an ``"all_to_all"`` of the bytes sent to the other ranks; ``logical_bytes`` (the same on every
    rank: the bucket's whole bytes) is what the debug mode compares, since the pieces differ per rank."""
    k, me = group.size(), group.rank()
    if debug.debug_enabled():
        debug.check("all_to_all", send[:0], logical_bytes, group, what)
    item = send.element_size()
    record_collective("all_to_all", (sum(send_splits) - send_splits[me]) * item, group, send.dtype)
    if k == 1:
        return None, send
    if recv is None:
        recv = torch.empty(sum(recv_splits), dtype=send.dtype, device=send.device)
    elif recv.numel() != sum(recv_splits) or recv.dtype != send.dtype:
        raise ValueError(f"exchange_uneven ({what}): recv has {recv.numel()} {recv.dtype} elements, the "
                         f"pieces {sum(recv_splits)} {send.dtype}")
    work = dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group, async_op=async_op)
    return (work if async_op else None), recv


def reduce_to_owners(send: torch.Tensor, send_splits: list[int], output: torch.Tensor,
                     group: dist.ProcessGroup, what: str = ""):
    """Sum pieces onto the ranks that own them (``perparam.runtime.paths.reduce_owner``): elements
    ``send_splits[r]`` of ``send`` (1-D, in rank order, ``send.numel()`` the same on every rank) go to rank r,
    and every rank receives ``output.numel()`` elements from each rank, its own included, summed in rank
    order into ``output`` at ``wait()`` (the arithmetic of ``reduce_scatter_sum``'s all-to-all: one add for
    K = 2, ``torch.sum`` over the ``[K, n]`` pieces for more). One all-to-all, recorded as a
    ``"reduce_scatter"`` of ``send``'s bytes (the reduce-scatter's convention: its input; on the wire each
    rank sends all but its own piece, as much in all as the reduce-scatter of the same gradients). Returns the
    work handle (``None`` for K = 1: ``output`` is ``send`` copied)."""
    k = group.size()
    if debug.debug_enabled():
        debug.check("reduce_scatter", send, send.numel() * send.element_size(), group, what)
    record_collective("reduce_scatter", send.numel() * send.element_size(), group, send.dtype)
    if k == 1:
        output.copy_(send)
        return None
    n = output.numel()
    raw = torch.empty(k * n, dtype=send.dtype, device=send.device)
    work = dist.all_to_all_single(raw, send, [n] * k, send_splits, group=group, async_op=True)
    pieces = raw.view(k, n)
    return _SumAfterAllToAll(work, [pieces[0], pieces[1]] if k == 2 else [pieces], output, None, None)


def all_gather_objects(obj, group: dist.ProcessGroup) -> list:
    """Every rank's picklable ``obj`` over ``group``, in rank order (``dist.all_gather_object``): for small
    metadata outside the training step (a checkpoint's owner-state descriptions). Not recorded."""
    if group.size() == 1:
        return [obj]
    out: list = [None] * group.size()
    dist.all_gather_object(out, obj, group=group)
    return out
