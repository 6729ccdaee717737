"""Which peer rank is gone when a collective fails, and the one error that says so (``PeerLostError``).

A rank whose peer died learns it from gloo ("Connection closed by peer", "Connection reset by peer") or
NCCL, with no word on which rank; a peer that was stopped (SIGSTOP, a debugger) leaves it waiting until the
process group's timeout. Each rank therefore posts its host and pid in the default process group's store
(``register``: at ``fully_shard`` and at each checkpoint save, one ``set`` the first time), and each rank's
roster of its peers is read back and kept. When a collective fails, ``explain`` asks which peers are gone:

- a peer on this host: ``/proc/<pid>/stat`` (gone or a zombie: dead; ``T``: stopped), exact;
- a peer on another host: its heartbeat (``perparam.elastic.StepWatchdog`` counts one in the store every
  ``BEAT_S`` seconds) unchanged over two beats: stopped or dead; without a heartbeat it is not known;
- the store itself unreachable: its host is gone (rank 0's process, where rank 0 hosts it).

The store is read through a client of its own with a short timeout (``QUERY_TIMEOUT``), so a stopped store
host cannot hang the question. The error also names the last complete checkpoint this process saved or
loaded (``note_checkpoint``) and the verdict a step watchdog posted (why it killed a rank). Nothing here
runs while collectives succeed: ``explain`` is called on the error path only.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from .timeouts import CollectiveTimeoutError

#: what a collective's or a store's error says when a peer is gone (or the connection to it broke)
LOST = ("by peer", "Connection closed", "Connection refused", "Broken pipe", "Socket closed",
        "NCCL communicator was aborted", "ncclRemoteError")
#: what it says when a peer did not answer in time (a peer gone only if one is found gone or stopped)
TIMED_OUT = ("Timed out", "timed out", "Timeout", "timeout")
#: seconds between two heartbeats of a ``StepWatchdog``; a peer whose count did not move in two is stopped
BEAT_S = 0.25
#: a store query on the error path waits at most this long (a stopped store host)
QUERY_TIMEOUT = timedelta(seconds=2)
PREFIX = "perparam_peers/"

#: per rank: (host, pid); filled by ``register`` as peers post theirs
_ROSTER: dict[int, tuple[str, int]] = {}
_state = {"world": None, "client": None, "checkpoint": None}
_lock = threading.Lock()


class PeerLostError(CollectiveTimeoutError):
    """A collective (or the store) failed because a peer rank died or was stopped: ``ranks`` the ranks found
    gone (empty when none could be named), ``checkpoint`` the last complete checkpoint this process knows
    (a folder, or None), ``cause`` the first line of the error that revealed it."""

    def __init__(self, message: str, ranks: list[int], checkpoint: str | None, cause: str) -> None:
        super().__init__(message)
        self.ranks, self.checkpoint, self.cause = ranks, checkpoint, cause

    def __reduce__(self):
        return type(self), (str(self), self.ranks, self.checkpoint, self.cause)


PeerLostError.__module__ = "perparam"  # its public name, as tracebacks print it


def note_checkpoint(path) -> None:
    """``path`` is a complete checkpoint (saved or loaded by every rank): named by the next
    ``PeerLostError``."""
    _state["checkpoint"] = str(path)


def last_checkpoint() -> str | None:
    return _state["checkpoint"]


def _default_store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def store():
    """A store for the peers' records: a client of its own (timeout ``QUERY_TIMEOUT``) of the default
    group's ``TCPStore``, or the default store itself where that is not a TCP store (a ``FileStore``);
    None without a default group."""
    if not dist.is_initialized():
        return None
    world = dist.group.WORLD
    with _lock:
        if _state["world"] is not world:
            _state["world"], _state["client"] = world, None
            _ROSTER.clear()
        if _state["client"] is None:
            base = inner = _default_store()
            if base is None:
                return None
            while hasattr(inner, "underlying_store"):
                inner = inner.underlying_store
            if isinstance(inner, dist.TCPStore):
                try:
                    inner = dist.TCPStore(inner.host, inner.port, is_master=False, timeout=QUERY_TIMEOUT,
                                          wait_for_workers=False)
                except (RuntimeError, dist.DistError):
                    return None
            _state["client"] = dist.PrefixStore(PREFIX, inner)
        return _state["client"]


def register() -> None:
    """Post this rank's host and pid (once per default group) and read the peers' posted so far: a few store
    operations until every peer's is known, nothing after."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    me, world = dist.get_rank(), dist.get_world_size()
    if len(_ROSTER) == world and _state["world"] is dist.group.WORLD:
        return
    s = store()
    if s is None:
        return
    try:
        if me not in _ROSTER:
            s.set(f"rank/{me}", f"{socket.gethostname()} {os.getpid()}")
            _ROSTER[me] = (socket.gethostname(), os.getpid())
        _read_roster(s, world)
    except (RuntimeError, dist.DistError):
        pass


def _read_roster(s, world: int) -> None:
    for r in range(world):
        if r not in _ROSTER and s.check([f"rank/{r}"]):
            host, pid = s.get(f"rank/{r}").decode().rsplit(" ", 1)
            _ROSTER[r] = (host, int(pid))


def roster() -> dict[int, tuple[str, int]]:
    """Rank -> (host, pid) of every peer known so far."""
    return dict(_ROSTER)


def proc_state(pid: int) -> str:
    """``"dead"`` (no such process, a zombie), ``"stopped"`` (SIGSTOP, a tracer) or ``"running"``."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "dead"
        except PermissionError:
            pass
        return "running"
    return {"Z": "dead", "X": "dead", "x": "dead", "T": "stopped", "t": "stopped"}.get(state, "running")


def beats(s, ranks: list[int]) -> dict[int, int]:
    """The heartbeat counts of ``ranks`` that have one (``StepWatchdog``)."""
    out = {}
    for r in ranks:
        key = f"beat/{r}"
        if s.check([key]):
            out[r] = int(s.get(key).decode())
    return out


def find_lost(wait_s: float = 2.0) -> tuple[list[tuple[int, str]], str | None]:
    """``([(rank, what)], store_problem)``: the peers found dead or stopped (``what``: ``"host h, pid p:
    process gone"``...), looking up to ``wait_s`` seconds while none is found (a dead peer's sockets close a
    moment before its process is reaped); ``store_problem``: why the store could not be asked, or None. The
    store is asked only for what the kept roster does not answer (a dead store host prints c10d warnings)."""
    if not dist.is_initialized():
        return [], None
    me, world, host = dist.get_rank(), dist.get_world_size(), socket.gethostname()
    problem = None
    s = store() if len(_ROSTER) < world else None
    try:
        if s is not None:
            _read_roster(s, world)
    except (RuntimeError, dist.DistError) as e:
        problem = f"the store did not answer ({str(e).splitlines()[0][:80]})"
    local = {r: pid for r, (h, pid) in _ROSTER.items() if r != me and h == host}
    remote = [r for r in range(world) if r != me and r not in local]
    deadline = time.monotonic() + wait_s
    before = None
    while True:
        lost = [(r, f"host {host}, pid {pid}: process {'gone' if state == 'dead' else 'stopped'}")
                for r, pid in sorted(local.items()) if (state := proc_state(pid)) != "running"]
        if not lost and remote and problem is None:
            try:
                s = s or store()
                now = beats(s, remote) if s is not None else {}
                if before is not None:
                    lost = [(r, f"host {_ROSTER.get(r, ('?', '?'))[0]}, pid {_ROSTER.get(r, ('?', '?'))[1]}: "
                             f"no heartbeat for {2 * BEAT_S:.1f} s") for r in now if now[r] == before.get(r)]
                before = now if before is None else before
            except (RuntimeError, dist.DistError) as e:
                problem = f"the store did not answer ({str(e).splitlines()[0][:80]})"
        if lost or time.monotonic() >= deadline:
            _state["store_ok"] = problem is None
            return sorted(lost), problem
        pause = 2 * BEAT_S if (before and problem is None) else 0.02
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))


def verdict(lost: list[int] = ()) -> str | None:
    """What a step watchdog said about a rank it found stopped (``StepWatchdog``: this process's, else the
    one posted in the store; not asked where rank 0, which may host the store, is among ``lost``), or None."""
    if _state.get("verdict") or not _state.get("store_ok", True) or 0 in lost:
        return _state.get("verdict")
    s = store()
    try:
        if s is not None and s.check(["verdict"]):
            return s.get("verdict").decode()
    except (RuntimeError, dist.DistError):
        pass
    return None


def post_verdict(line: str, share: bool = True) -> None:
    """Keep ``line`` (a watchdog's finding) and, with ``share``, post it for the peers' ``PeerLostError``."""
    _state["verdict"] = line
    s = store() if share else None
    try:
        if s is not None:
            s.set("verdict", line)
    except (RuntimeError, dist.DistError):
        pass


def _text(error: BaseException) -> str:
    """The error's text with, for DCP's ``CheckpointException``, each rank's failure."""
    text = str(error)
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict):
        text += " " + " ".join(str(pair[0]) for pair in failures.values())
    cause = error.__cause__
    return text + (" " + _text(cause) if cause is not None and cause is not error else "")


def _first_line(text: str) -> str:
    import re

    for line in text.splitlines():
        line = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", line.strip())  # gloo's source location
        if any(s in line for s in LOST + TIMED_OUT):
            return line.split(". ")[0][:160]
    return text.strip().splitlines()[0][:160] if text.strip() else ""


def explain(error: BaseException, where: str) -> PeerLostError | None:
    """``PeerLostError`` for ``error`` (raised by a collective or the store during ``where``) when a peer is
    gone: its text says a connection to a peer broke, or it timed out and a peer is found dead or stopped;
    None for any other error (and for a ``PeerLostError`` already made)."""
    if isinstance(error, PeerLostError) or not dist.is_initialized():
        return None
    text = _text(error)
    broke = any(s in text for s in LOST)
    if not broke and not any(s in text for s in TIMED_OUT):
        return None
    lost, problem = find_lost(wait_s=2.0 if broke else 0.0)
    if not lost and not broke:
        return None
    return _error(lost, problem, where, _first_line(text))


def lost_error(where: str) -> PeerLostError | None:
    """``PeerLostError`` when a peer is found dead or stopped now (``find_lost``, no waiting), else None: for
    a wait that no connection to the peer ends (the store's agreement before a collective)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    lost, problem = find_lost(wait_s=0.0)
    return _error(lost, problem, where, "its post never came") if lost else None


def _error(lost: list[tuple[int, str]], problem: str | None, where: str, cause: str) -> PeerLostError:
    me = dist.get_rank()
    if lost:
        who = "; ".join(f"rank {r} ({what})" for r, what in lost)
    elif problem is not None and 0 in _ROSTER and _ROSTER[0][0] != socket.gethostname():
        who = f"rank 0's host, which holds the store ({problem})"
    else:
        who = "a peer rank (which one is not known: no peer on this host is gone" + (
            f", {problem}" if problem else ", and peers on other hosts send no heartbeat") + ")"
    why = verdict([r for r, _ in lost])
    saved = _state["checkpoint"]
    line = (f"perparam: rank {me} lost {who} during {where}" + (f" [{why}]" if why else "") +
            f"; last complete checkpoint: {saved or 'none saved or loaded by this process'} ({cause})")
    return PeerLostError(line, [r for r, _ in lost], saved, cause)


class lost_peers:  # noqa: N801 (a context manager and decorator, used as a function)
    """``with lost_peers("checkpoint.save"):``: an error of a collective whose peer is gone becomes
    ``PeerLostError`` (raised from None: the collective's traceback adds nothing; its first line is in the
    message). Costs nothing while no error is raised."""

    def __init__(self, where: str) -> None:
        self.where = where

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb) -> bool:
        if error is None or not isinstance(error, (RuntimeError, dist.DistError)) and \
                type(error).__name__ != "CheckpointException":
            return False
        lost = explain(error, self.where)
        if lost is not None:
            raise lost from None
        return False

    def __call__(self, fn):
        import functools

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with lost_peers(self.where):
                return fn(*args, **kwargs)

        return wrapper
