"""Debug mode: before each collective, check across ranks that every rank issues the same one.

Off by default. Turn it on with ``perparam.set_debug(True)`` or the environment variable
``PERPARAM_DEBUG=1``. Before every all-gather, reduce-scatter and all-reduce perparam issues, the ranks of
the collective's process group exchange a 6-number descriptor (kind, send bytes, receive bytes, dtype,
a hash of the group's and parameters' names, the group size) in one extra all-gather of 48 bytes per
rank. When the descriptors differ, the ranks exchange the readable descriptions too and **every** rank
raises ``CollectiveMismatchError`` naming, per rank, the group, its parameters, the sizes and dtypes;
nothing hangs and nothing is silently reduced with the wrong partner. (A rank that issues no collective
at all while its peers do still hangs: the process group's timeout ends it.)

Cost: one small synchronous all-gather per collective, which also serialises the prefetching; measured
in the closing note of the issue that added it. Use it to find a mismatch, not in production.

Known limit: the check makes every gradient reduction synchronous, so debug mode can hang a backward in
which the ranks use different parameters (one rank does not use a branch's output: its peers' check of
that branch's reduction waits for it, while it waits in an all-gather they have yet to issue). Without
debug mode that backward runs (reductions are never waited for in backward, ``perparam.runtime.context``). The fix
would run the checks on a process group of their own and issue each reduction once its check is seen to
have finished, in queue order; not done yet.
"""

from __future__ import annotations

import os
import zlib

import torch
import torch.distributed as dist

_enabled = os.environ.get("PERPARAM_DEBUG", "") not in ("", "0")
_KINDS = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 3}


class CollectiveMismatchError(RuntimeError):
    """The ranks of a process group were about to issue different collectives (debug mode)."""


def set_debug(enabled: bool) -> None:
    """Turn the cross-rank collective check on or off for this process (see the module docstring)."""
    global _enabled
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
    dist.all_gather_single(gathered, local, group=group)
    rows = gathered.view(group.size(), len(mine)).tolist()
    if all(row == rows[0] for row in rows):
        return
    described = [None] * group.size()
    dist.all_gather_object(described, f"{kind} of {send_bytes} bytes sent / {recv_bytes} received, "
                                      f"{send.dtype}, for {what}", group=group)
    lines = "\n".join(f"  rank {dist.get_global_rank(group, i)}: {d}" for i, d in enumerate(described))
    raise CollectiveMismatchError(
        "perparam debug: the ranks are about to issue different collectives (a rank used other sharded "
        "modules, other parameters or other shapes than its peers):\n" + lines)
