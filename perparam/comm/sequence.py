"""Outside debug mode: an all-gather sequence never seen before is agreed on by the ranks before it is issued.

Ranks that make different numbers of sharded calls (a rank-dependent loop, an extra forward on one rank)
issue collectives of different sizes that gloo pairs up anyway; gloo then aborts the process (SIGABRT from
its I/O thread: "Received data size doesn't match expected size"), which no Python code can catch.

Only all-gathers are checked (``collectives.all_gather_rows`` / ``all_gather_in_place``): they are issued in
the same order on every rank and a rank may wait for its peers before one (a peer never waits, before
issuing its all-gathers, for something this rank issues later: the final callback issues the remaining
all-gathers before it finishes reductions). Reductions are never waited for in backward
(``perparam.runtime.hooks``), so a check before one could deadlock (debug mode's known limit): a mismatch
there still reaches gloo. The all-gathers are what a different number of sharded calls changes first.

Each rank remembers, per process group, every run of ``CONTEXT`` consecutive all-gathers it has issued,
a collective being (kind, bytes sent, bytes received, what it carries), kept as its hash. A training loop
repeats the same runs every step, so from its third step on nothing new is seen and the check is a dict
lookup, a tuple and a set lookup per collective (about 2 us on a loaded 2-core machine; ``expect``); each
new run costs one agreement (a few store operations and the wait for the peers: 1.6 ms on that machine,
a FileStore). A run not seen before (the first steps, a
change of the model's order that every rank makes alike, or a rank that left the common order) is first
posted in the default process group's store, and the rank waits there for its peers' posts of the same
check: equal, it goes on; a different collective, every rank that reached the check raises
``CollectiveMismatchError`` naming each rank's; a peer that never posts (it issued a run it had seen, or
nothing), the rank raises after the process group's own timeout (never earlier than the collective would
have failed) naming the peers missing. The peer that never posted waits in its collective meanwhile, with no
partner of another size: no abort. Debug mode (``perparam.set_debug(True)``) replaces this with its check
before every collective.

Not detected: ranks that each issue runs they have seen before, in another order (a model whose order
changes between steps differently per rank), and ranks whose collectives are the same ones in a different
number (evaluation with different numbers of batches): they wait in the collective until the timeout,
whose error perparam names (``perparam.module``; ``docs/evaluation.md`` shows how to evaluate instead).
"""

from __future__ import annotations

import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from . import peers
from .debug import CollectiveMismatchError
from .timeouts import CollectiveTimeoutError  # noqa: F401 (re-exported: raised here)

_KEY = "perparam_seq/{}/{}/"  # (process group name, check number) / rank


#: collectives per run: a run is new when this collective or one of the CONTEXT - 1 before it differs from
#: every run seen (a backward re-gathers what the forward gathered, so pairs alone repeat too easily)
CONTEXT = 4


class _Seen:
    __slots__ = ("last", "runs", "checks")

    def __init__(self) -> None:
        self.last: tuple = ()
        self.runs: set[tuple] = set()
        self.checks = 0


#: id(process group) -> (weak reference to it, _Seen): a freed group is not kept alive here (process groups
#: alive at interpreter exit abort it), and a new group with a freed one's id starts afresh
_state: dict[int, tuple] = {}


def expect(kind: str, send_bytes: int, recv_bytes: int, group: dist.ProcessGroup, what: str) -> None:
    """Before a collective on ``group`` (more than one rank): agree with the peers first when the run of
    ``CONTEXT`` collectives ending with this one is new on this group (see the module docstring). Raises
    ``CollectiveMismatchError`` on a difference or when a peer does not reach the check in the process
    group's timeout. Cost when the run is known: a dict lookup, a tuple and a set lookup."""
    entry = _state.get(id(group))
    if entry is None or entry[0]() is not group:
        entry = _state[id(group)] = (weakref.ref(group), _Seen())
    seen = entry[1]
    run = (*seen.last[1 - CONTEXT:], hash((kind, send_bytes, recv_bytes, what)))
    if run not in seen.runs:
        _agree(seen, group, f"{kind} of {send_bytes} bytes sent / {recv_bytes} received, for {what}")
        seen.runs.add(run)
    seen.last = run


def _timeout(group: dist.ProcessGroup) -> timedelta:
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (RuntimeError, AttributeError, ValueError):
        return dist.default_pg_timeout


def _wait(store, keys: list[str], timeout: timedelta) -> None:
    """Until every key of ``keys`` is set: polled for the first 50 ms (peers reach a check at about the same
    time; a FileStore's ``wait`` sleeps 10 ms per poll), then ``store.wait`` for the rest of ``timeout``."""
    start, pause = time.monotonic(), 5e-5
    while time.monotonic() - start < 0.05:
        if store.check(keys):
            return
        time.sleep(pause)
        pause = min(2 * pause, 2e-3)
    while True:  # in slices of a second: a peer that died or stopped meanwhile never posts (PeerLostError)
        left = timeout.total_seconds() - (time.monotonic() - start)
        try:
            store.wait(keys, timedelta(seconds=max(min(left, 1.0), 0.001)))
            return
        except (RuntimeError, dist.DistStoreError):
            if left <= 1.0:
                raise
        lost = peers.lost_error("a wait for the peers in the store (before a collective)")
        if lost is not None:
            raise lost


class _Late(Exception):
    """Peers of ``_arrive`` that did not post within the timeout (``missing``), and the store's error."""

    def __init__(self, missing: list[int], timeout: timedelta, error: BaseException) -> None:
        super().__init__(missing)
        self.missing, self.timeout, self.error = missing, timeout, error


def _arrive(group: dist.ProcessGroup, prefix: str, value: str):
    """Post ``value`` at ``prefix + <this rank>`` in the default store and wait for every rank of ``group`` to
    post at ``prefix``, for the group's timeout: ``(store, ranks, keys)``; ``None`` where there is nothing to
    agree through (no default group or store, or a store that cannot set: torch's fake process group's).
    Raises ``_Late`` naming the ranks that did not post."""
    try:
        store = dist.distributed_c10d._get_default_store()
        ranks = dist.get_process_group_ranks(group)
        me = dist.get_rank()
    except (RuntimeError, ValueError, AttributeError):
        return None
    try:
        store.set(prefix + str(me), value)
    except RuntimeError:
        return None
    keys = [prefix + str(r) for r in ranks]
    timeout = _timeout(group)
    try:
        _wait(store, keys, timeout)
    except peers.PeerLostError:
        raise
    except (RuntimeError, dist.DistStoreError) as e:
        raise _Late([r for r, k in zip(ranks, keys) if not store.check([k])], timeout, e) from e
    return store, ranks, keys


def _agree(seen: _Seen, group: dist.ProcessGroup, described: str) -> None:
    seen.checks += 1
    me = dist.get_rank() if dist.is_initialized() else 0
    try:
        arrived = _arrive(group, _KEY.format(group.group_name, seen.checks), described)
    except _Late as late:
        raise CollectiveMismatchError(
            f"perparam: rank {me} was about to issue {described} on process group {group.group_name!r} "
            f"(ranks {dist.get_process_group_ranks(group)}), the first time in this order, and ranks "
            f"{late.missing} did not reach the same point within "
            f"{late.timeout.total_seconds():.0f} s: the ranks made different numbers of sharded calls (a "
            "rank-dependent loop or branch, an extra forward on some ranks, different numbers of batches). "
            "Every rank must call the same sharded modules in the same order; perparam.set_debug(True) names "
            "each rank's collective, and docs/evaluation.md shows how to evaluate different numbers of "
            "batches per rank") from late.error
    if arrived is None:
        return
    store, ranks, keys = arrived
    many = getattr(store, "multi_get", None)  # one round trip where the store has it
    posts = [p.decode() for p in (many(keys) if many is not None else [store.get(k) for k in keys])]
    if any(p != described for p in posts):
        lines = "\n".join(f"  rank {r}: {p}" for r, p in zip(ranks, posts))
        raise CollectiveMismatchError(
            f"perparam: the ranks of process group {group.group_name!r} were about to issue different "
            "collectives (they made different numbers of sharded calls, or called other sharded modules; "
            "perparam.set_debug(True) checks every collective):\n" + lines)


_ENTER_KEY = "perparam_enter/{}/{}/{}/"  # (process group name, what, call number) / rank
#: process group -> what -> calls agreed so far (by the group object: ranks running as threads of one process
#: each have theirs; a freed group's entry goes with it)
_entered: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def enter_together(group: dist.ProcessGroup, what: str, fix: str) -> None:
    """Before the collectives of ``what`` (a call users make by hand, e.g. ``"optimizer.state_dict()"``),
    which every rank of ``group`` must make: each rank posts its arrival in the default store and waits for
    its peers' for the group's timeout. A peer that does not arrive (the call made on one rank: ``if rank ==
    0: torch.save(opt.state_dict(), ...)``) raises ``CollectiveTimeoutError`` naming the missing ranks and
    ``fix``, before any collective is issued, so the group stays usable (its own collective would have
    timed out with gloo's "Application timeout caused pair closure", the group broken after it). The refused
    call is withdrawn (its post deleted, the count kept), so a later call on every rank agrees. NCCL: the
    peers that went on wait in their next collective, which this rank never issues; NCCL's watchdog aborts
    them at the same timeout and may end the job before this error is printed. Nothing to agree through (no
    default store, one rank): returns at once."""
    if group.size() == 1:
        return
    counts = _entered.setdefault(group, {})
    count = counts.get(what, 0) + 1
    prefix = _ENTER_KEY.format(group.group_name, what, count)
    try:
        arrived = _arrive(group, prefix, "1")
    except _Late as late:
        me = dist.get_rank()
        try:
            dist.distributed_c10d._get_default_store().delete_key(prefix + str(me))
        except (RuntimeError, NotImplementedError):
            pass
        raise CollectiveTimeoutError(
            f"perparam: rank {me} called {what}, and ranks {late.missing} of process group "
            f"{group.group_name!r} (ranks {dist.get_process_group_ranks(group)}) did not call it within its "
            f"timeout of {late.timeout.total_seconds():.0f} s: {what} is a collective here; "
            f"{fix}") from late.error
    if arrived is None:
        return
    counts[what] = count


#: what gloo's errors say when a peer did not issue the collective (a timeout) or exited while it waited
_STALLED = ("Timed out waiting", "Connection closed by peer", "Connection reset by peer")


def explain_wait(error: BaseException, where: str) -> CollectiveTimeoutError | None:
    """``CollectiveTimeoutError`` for c10d's error from a collective that timed out or lost its peer, raised
    in ``where`` (the sharded module's forward), naming the cause, debug mode and ``docs/evaluation.md``;
    ``None`` for any other error. Only the error path calls it."""
    if isinstance(error, CollectiveTimeoutError):
        return None
    text = str(error)
    if not any(s in text for s in _STALLED):
        return None
    first = text.splitlines()[0] if text else type(error).__name__
    return CollectiveTimeoutError(
        f"perparam: {where} waited for a collective that a peer rank did not issue ({first}). The ranks made "
        "different numbers of sharded calls (evaluation with different numbers of batches per rank, a "
        "rank-dependent loop, an early exit on some rank), or a peer failed first (read its error). Every "
        "forward of a sharded module all-gathers, so every rank must run it: to evaluate different numbers "
        "of batches per rank keep the parameters gathered (docs/evaluation.md: "
        "set_reshard_after_forward(False) and unshard() on every sharded module before the first batch); "
        "perparam.set_debug(True) names each rank's collective")
