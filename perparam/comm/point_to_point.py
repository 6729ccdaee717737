"""The zero-copy collectives on gloo: per-tensor point-to-point sends and receives straight between the
tensors' places (``all_gather_in_place``, ``reduce_scatter_in_place``), and the waiter threads that let the
queue poll gloo's send/receive works. Counted as one all-gather or reduce-scatter each
(``perparam.comm.counter``); re-exported by ``perparam.comm.collectives``."""

from __future__ import annotations

import atexit
import os
import queue
import threading
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from . import debug, sequence
from .counter import GatheredRows, record_collective, take_buffer

_lock = threading.Lock()  # the waiters' registry


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
        debug.check("all_gather", torch.empty((), dtype=torch.uint8).expand(slot_bytes), k * slot_bytes,
                    group, what)
    elif k > 1:
        sequence.expect("all_gather", slot_bytes, k * slot_bytes, group, what)
    record_collective("all_gather", k * slot_bytes, group, torch.uint8)
    works = _post_rotation(group, len(regions), lambda tag, dst: regions[tag][me],
                           lambda tag, src: regions[tag][src])
    result = GatheredRows(_PointToPoint(works), None, [])
    if not async_op:
        result.wait()
    return result


class _Waiter:
    """A daemon thread that waits on the point-to-point works of one process group, in the order given
    (``ProcessGroupGloo``'s send and receive works report ``is_completed()`` only once waited on), so a
    reduction in flight can be polled without blocking (``_SumAfterPointToPoint.is_completed``). One per
    process group: ranks that run as threads of one process each have theirs, so one rank's wait never
    holds up another's.

    The thread frees every work it was given before it sets ``done``: freeing a work releases and retakes
    the GIL (torch's ``Work`` binding), and a daemon thread that retakes it while the interpreter finalizes
    is ended with ``pthread_exit``, which aborts the process from inside that C++ destructor ("terminate
    called without an active exception"). Once ``done`` is set the owner may finish the script and exit;
    the thread then runs only Python code until it blocks on its queue. At exit (``_stop_at_exit``) each
    thread is told to end and joined, so none is still inside a wait when the interpreter finalizes."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="perparam-p2p-waiter", daemon=True)
        self.thread.start()
        _threads.add(self.thread)

    def watch(self, works: list, done: threading.Event, errors: list) -> None:
        """Wait on ``works`` (the list is emptied: the thread holds the only references), then set
        ``done``; a work's exception is appended to ``errors`` (without its traceback) first."""
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
            item = None
            _wait_and_free(works, errors)
            works = None
            done.set()  # the last statement touching the item: no work is alive in this thread past here


def _wait_and_free(works: list, errors: list) -> None:
    """Wait on each work in order and drop it (``works`` ends empty): the last reference to every work goes
    in this frame, before the caller sets ``done``."""
    while works:
        work = works.pop(0)
        try:
            work.wait()
        except Exception as e:  # re-raised by the owner's wait(); a traceback would keep this frame's work
            errors.append(e.with_traceback(None))
        work = None


_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()  # waiter threads, joined at exit


@atexit.register
def _stop_at_exit(timeout_s: float = 10.0) -> None:
    """Tell every waiter thread of this process to end and join it (each at most ``timeout_s`` seconds):
    atexit runs before the interpreter finalizes, so no waiter is then still waiting on, or freeing, a work
    (an owner that exits with a reduction still in flight, on an error's way out; a work that never
    completes leaves its thread to the interpreter after the timeout). A reduction issued later (another
    exit hook) starts a new thread."""
    with _lock:
        waiters = list(_waiters.values())
        _waiters.clear()
    for waiter in waiters:
        waiter.retire()
    for thread in list(_threads):
        if thread.is_alive() and thread is not threading.current_thread():
            thread.join(timeout_s)


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
    record_collective("reduce_scatter", k * output.numel() * output.element_size(), group, dtype)
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
        raw = take_buffer(pool, k * n * output.element_size(), device)
        rows = raw.view(dtype).view(k, n)
        slots = [[rows[r].narrow(0, off, piece.numel()) for r in range(k)]
                 for off, piece in zip(offsets, own)]
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
