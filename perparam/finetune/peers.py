"""Which peer of a ``perparam finetune`` worker is gone, and the one line that says so.

A worker learns that a peer is gone in one of two ways: a collective fails ("Connection closed by peer",
a timeout), or, under ``torchrun`` across nodes, its own agent stops it with SIGTERM because the agent lost
the rendezvous store (hosted by the node that died). The second looks like a user's interruption; it is
told apart by probing the stores the job depends on, which a user's signal leaves running (the agent
stops its workers before it exits):

- the **roster**: every rank's host, pid and node (``GROUP_RANK``), gathered once at set-up
  (:func:`record_roster`); a peer on this host whose process no longer runs is named exactly;
- the **workers' store** (``MASTER_ADDR:MASTER_PORT``, hosted by node 0's agent under ``torchrun``, by the
  launcher under ``perparam finetune``) and the **rendezvous store** (``torchrun --rdzv-endpoint``, read
  from the agent's command line on Linux): a store that refuses connections is a node that is gone.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

#: what a collective's error says when a peer is gone (the job's one lost-peer line instead of a traceback)
PEER_LOST = ("by peer", "Connection closed", "Connection refused", "Broken pipe", "timed out", "Timed out",
             "NCCL communicator was aborted", "ncclRemoteError")

#: per global rank: {"host": hostname, "pid": process id, "node": GROUP_RANK}; empty until recorded
ROSTER: list[dict] = []
#: torchrun's default rendezvous port (``torch.distributed.elastic``'s c10d backend)
DEFAULT_RDZV_PORT = 29400


def record_roster() -> None:
    """Gather every rank's host, pid and node into :data:`ROSTER` (a collective: every rank calls it once,
    after the default process group is up)."""
    import torch.distributed as dist

    mine = {"host": socket.gethostname(), "pid": os.getpid(), "node": int(os.environ.get("GROUP_RANK", "0"))}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    ROSTER[:] = everyone


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, or a process that is exiting, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return pid_alive(pid)
    return state not in ("Z", "X", "x")


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (signal 0; one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def dead_ranks(other_nodes_only: bool = False, wait_s: float = 0.0) -> list[int]:
    """Ranks of :data:`ROSTER` on this host whose process no longer runs (``other_nodes_only``: of other
    nodes only; this node's get the same signal from the same agent). ``wait_s``: keep looking that long
    while none is found (a peer's sockets close a moment before its process is gone)."""
    host, me = socket.gethostname(), int(os.environ.get("RANK", "0"))
    node = int(os.environ.get("GROUP_RANK", "0"))
    candidates = [r for r, e in enumerate(ROSTER)
                  if r != me and e["host"] == host and not (other_nodes_only and e["node"] == node)]
    deadline = time.monotonic() + wait_s
    while True:
        dead = [r for r in candidates if not _running(ROSTER[r]["pid"])]
        if dead or not candidates or time.monotonic() >= deadline:
            return dead
        time.sleep(0.05)


def reachable(host: str, port: int, timeout_s: float = 2.0) -> bool:
    """Whether a TCP connection to ``host:port`` opens within ``timeout_s`` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def rendezvous_endpoint(argv: list[str] | None = None) -> tuple[str, int] | None:
    """``(host, port)`` of ``torchrun``'s ``--rdzv-endpoint``/``--rdzv_endpoint`` (``PET_RDZV_ENDPOINT`` in
    the environment, else the parent's command line, or ``argv``); None where there is none (our own
    launcher hosts its store itself)."""
    value = os.environ.get("PET_RDZV_ENDPOINT")
    if value is None:
        if argv is None:
            try:
                argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                return None
        for i, arg in enumerate(argv):
            if arg in ("--rdzv-endpoint", "--rdzv_endpoint") and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith(("--rdzv-endpoint=", "--rdzv_endpoint=")):
                value = arg.split("=", 1)[1]
    if not value:
        return None
    host, _, port = value.rpartition(":") if value.rsplit(":", 1)[-1].isdigit() else (value, "", "")
    return host.strip("[]"), int(port) if port else DEFAULT_RDZV_PORT


def lost_stores() -> list[str]:
    """The stores this worker depends on that no longer accept connections, described (node 0's store
    first)."""
    lost = []
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port and port.isdigit() and not reachable(addr, int(port)):
        lost.append(f"node 0 (host of the workers' store {addr}:{port})")
    endpoint = rendezvous_endpoint()
    if endpoint is not None and (endpoint[0], str(endpoint[1])) != (addr, port) and not reachable(*endpoint):
        lost.append(f"the node hosting the rendezvous store {endpoint[0]}:{endpoint[1]}")
    return lost


def who_is_gone(other_nodes_only: bool = False, wait_s: float = 0.0) -> str | None:
    """``"rank 1 (node 1) is gone"``, ``"node 0 (host of ...) is gone"``, or None when nothing shows a
    peer gone (a peer that hangs, or one on another host whose stores still answer)."""
    dead = dead_ranks(other_nodes_only, wait_s)
    if dead:
        one_node = len({e["node"] for e in ROSTER}) == 1
        names = ", ".join(f"rank {r}" + ("" if one_node else f" (node {ROSTER[r]['node']})") for r in dead)
        return f"{names} {'is' if len(dead) == 1 else 'are'} gone"
    lost = lost_stores()
    return f"{lost[0]} is gone" if lost else None


def lost_peer_line(rank: int | str, gone: str | None, cause: str | None,
                   checkpoint: tuple[int, str] | None) -> str:
    """The one line of a worker that stops because a peer is gone (``gone``: :func:`who_is_gone`'s text;
    ``cause``: the collective's error, shortened; ``checkpoint``: ``(step, folder)`` of the last complete
    ``--save``, or None)."""
    what = "a peer process died" if gone else "a peer process died or hung"
    detail = gone or "no peer is known to be gone"
    if cause:
        detail += f"; during a collective: {cause}"
    saved = ("nothing saved" if checkpoint is None
             else f"last checkpoint: step {checkpoint[0]} in {checkpoint[1]}")
    return f"perparam finetune: rank {rank} stopped: {what} ({detail}); {saved}"

