"""Debug mode: before each collective, check across ranks that every rank issues the same one.

Off by default. Turn it on with ``perparam.set_debug(True)`` or the environment variable
``PERPARAM_DEBUG=1``. Before every all-gather, reduce-scatter and all-reduce perparam issues, the ranks of
the collective's process group exchange a 6-number descriptor (kind, send bytes, receive bytes, dtype,
a hash of the group's and parameters' names, the group size) in one extra all-gather of 48 bytes per
rank. When the descriptors differ, the ranks exchange the readable descriptions too and **every** rank
raises ``CollectiveMismatchError`` naming, per rank, the group, its parameters, the sizes and dtypes;
nothing hangs and nothing is silently reduced with the wrong partner.

When the ranks diverge across process groups (one rank checks an all-gather while a peer, which skipped a
branch, checks a reduction on the reduction group, or issues nothing), no check can pair up. So a rank whose
check has waited for more than 10 ms posts the collective it checks in the default process group's store
(one small write; a run whose ranks agree rarely waits that long), and a check that has not finished within
the debug timeout (``set_debug(True, timeout_s=...)``, ``PERPARAM_DEBUG_TIMEOUT`` in seconds; 60 s by default,
below c10d's own timeouts) raises ``CollectiveMismatchError`` on each rank waiting in one: it names the
process group and its ranks, the ranks that did not reach the check and the collective each of them last
posted (or that it posted none). The check's own all-gather is left unfinished: the process groups are
unusable after the error (as after a c10d timeout); fix the model and start again.

Cost: one small synchronous all-gather per collective, which also serialises the prefetching; measured
in the closing note of the issue that added it. Use it to find a mismatch, not in production.

Known limit: the check makes every gradient reduction synchronous, so debug mode can stop a backward in
which the ranks use different parameters (one rank does not use a branch's output: its peers' check of
that branch's reduction waits for it, while it waits in an all-gather they have yet to issue) with the
timeout's error, where without debug mode that backward runs (reductions are never waited for in
backward, ``perparam.runtime.context``). The fix would run the checks on a process group of their own
and issue each reduction once its check is seen to have finished, in queue order; not done yet.
"""

from __future__ import annotations

import os
import time
import zlib
from types import MappingProxyType

import torch
import torch.distributed as dist

from . import c10d

_enabled = os.environ.get("PERPARAM_DEBUG", "") not in ("", "0")
_timeout_s = float(os.environ.get("PERPARAM_DEBUG_TIMEOUT", "60"))
_KEY = "perparam_debug/rank{}"  # the default store's key where a rank posts the collective it checks
_KINDS = MappingProxyType({"all_gather": 1, "reduce_scatter": 2, "all_reduce": 3, "all_to_all": 4})


class CollectiveMismatchError(RuntimeError):
    """The ranks of a process group were about to issue different collectives (debug mode)."""


def set_debug(enabled: bool, timeout_s: float | None = None) -> None:
    """Turn the cross-rank collective check on or off for this process (see the module docstring).
    ``timeout_s``: seconds a check waits for the peers before raising ``CollectiveMismatchError`` (``None``
    keeps the current value: 60 s, or ``PERPARAM_DEBUG_TIMEOUT``). Raises ``ValueError`` for a timeout
    that is not positive, ``TypeError`` for an ``enabled`` that is not a bool."""
    global _enabled, _timeout_s
    if not isinstance(enabled, bool):  # set_debug("no") would otherwise turn the checks on
        raise TypeError(f"set_debug takes True or False, got {enabled!r}")
    if timeout_s is not None:
        if not timeout_s > 0:
            raise ValueError(f"set_debug: timeout_s must be a positive number of seconds, got {timeout_s!r}")
        _timeout_s = float(timeout_s)
    _enabled = bool(enabled)


def debug_enabled() -> bool:
    return _enabled


def _dtype_code(dtype: torch.dtype) -> int:
    return zlib.crc32(str(dtype).encode()) & 0x7FFFFFFF


def check(kind: str, send: torch.Tensor, recv_bytes: int, group: dist.ProcessGroup, what: str) -> None:
    """Raise ``CollectiveMismatchError`` on every rank of ``group`` unless all ranks are about to issue the
    same ``kind`` of collective with the same byte counts, dtype and description ``what``."""
    if group.size() == 1:
        return
    send_bytes = send.numel() * send.element_size()
    mine = [_KINDS[kind], send_bytes, recv_bytes, _dtype_code(send.dtype),
            zlib.crc32(what.encode()) & 0x7FFFFFFF, group.size()]
    local = torch.tensor(mine, dtype=torch.int64, device=send.device)
    gathered = torch.empty(group.size() * len(mine), dtype=torch.int64, device=send.device)
    described = f"{kind} of {send_bytes} bytes sent / {recv_bytes} received, {send.dtype}, for {what}"
    work = c10d.all_gather_into(gathered, local, group, async_op=True)
    _wait(work, group, described)
    rows = gathered.view(group.size(), len(mine)).tolist()
    if all(row == rows[0] for row in rows):
        return
    everyone = [None] * group.size()
    dist.all_gather_object(everyone, described, group=group)
    lines = "\n".join(f"  rank {dist.get_global_rank(group, i)}: {d}" for i, d in enumerate(everyone))
    raise CollectiveMismatchError(
        "perparam debug: the ranks are about to issue different collectives (a rank used other sharded "
        "modules, other parameters or other shapes than its peers):\n" + lines)


def _group_name(group: dist.ProcessGroup) -> str:
    desc = getattr(group, "group_desc", "")
    return f"{desc or group.group_name!r} (ranks {dist.get_process_group_ranks(group)})"


def _post(described: str):
    """Write the collective this rank is checking to the default store; the store, or ``None`` when there is
    none (no default process group, or one without a store)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(_KEY.format(dist.get_rank()), described)
    except (RuntimeError, ValueError, AttributeError):
        return None
    return store


def _posted(store, rank: int) -> str | None:
    key = _KEY.format(rank)
    try:
        return store.get(key).decode() if store.check([key]) else None
    except (RuntimeError, ValueError):
        return None


_POST_AFTER_S = 0.01


def _wait(work, group: dist.ProcessGroup, described: str) -> None:
    """Wait for the check's all-gather, at most the debug timeout (posting what it checks once it has waited
    ``_POST_AFTER_S``); then raise ``CollectiveMismatchError`` naming the ranks of ``group`` that did not
    reach this check and what each of them last posted."""
    start = time.monotonic()
    here = f"{described} on process group {_group_name(group)}"
    store, posted = None, False
    pause = 1e-4
    while not work.is_completed():
        waited = time.monotonic() - start
        if waited > _timeout_s:
            break
        if not posted and waited > _POST_AFTER_S:
            store, posted = _post(here), True
        time.sleep(pause)
        pause = min(pause * 2, 0.002)
    else:
        work.wait()
        return
    me = dist.get_rank()
    lines, behind = [], []
    for rank in dist.get_process_group_ranks(group):
        if rank == me:
            continue
        other = _posted(store, rank) if store is not None else None
        if other != here:
            behind.append(rank)
            lines.append(f"  rank {rank}: last posted {other}" if other
                         else f"  rank {rank}: posted no collective")
    detail = ("\n".join(lines) if lines
              else "  (every peer posted this same collective: one is slow or stopped)")
    raise CollectiveMismatchError(
        f"perparam debug: rank {me} waited {_timeout_s:g} s for its peers to check {described} on process "
        f"group {_group_name(group)}; ranks {behind} did not reach this check (a rank called other sharded "
        "modules than its peers, skipped a branch or a backward, or stopped):\n" + detail
        + "\nMake every rank call the same "
        "sharded modules in the same order and run every backward; the process groups are unusable after "
        "this error (set_debug(True, timeout_s=...) waits longer)")
