"""The machinery of ``perparam.checkpoint.async_save``: the snapshot, the writer thread, its process group,
and the saves still in flight (waited for before the next save, by ``distributed_session`` and at exit).

Why a process group of its own: the background write issues DCP's collectives (plan gather, the write
barrier, the commit) while the training thread issues its all-gathers and reduce-scatters; on one shared
group their order differs between ranks and both sides stall until the group's timeout (torch's own
``dcp.async_save`` on the default group does this too). One gloo group over all ranks, created by the first
asynchronous save (a collective) and reused by every later one, carries only checkpoint traffic.

Why a snapshot of our own: DCP's stager (``FileSystemWriter.stage``, torch 2.13) hands 0-dim DTensors back
uncopied, so a 0-dim parameter updated after the save returned would leak into the checkpoint; here every
tensor is copied (DTensors rebuilt around the copied local shard, which stays on the CPU: a DTensor of the
CUDA mesh with a host local tensor, as torch's CPU state dicts make).
"""

from __future__ import annotations

import atexit
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..comm.peers import explain
from ..errors import CheckpointError

_LOCK = threading.Lock()
_EXECUTOR: ThreadPoolExecutor | None = None
_PENDING: list[PendingSave] = []
_GROUP: tuple[object, dist.ProcessGroup] | None = None  # (the default group it was made under, the group)


class PendingSave:
    """A checkpoint being written in the background, returned by ``perparam.checkpoint.async_save``.

    ``path``: the folder it will be at once complete. ``done()``: the write finished (successfully or not).
    ``wait(timeout_s=None)``: blocks until it is complete and returns ``path``; raises ``CheckpointError``
    naming ``path`` and the cause when the background write failed (on every rank), and ``TimeoutError``
    after ``timeout_s`` seconds. A failure is never lost: if nobody called this ``wait()``, the next
    ``save``/``async_save``/``wait_pending()`` raises it (once), or it is printed to stderr at exit.
    """

    def __init__(self, path: Path, future: Future) -> None:
        self.path = path
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout_s: float | None = None) -> Path:
        try:
            self._future.result(timeout=timeout_s)
        except BaseException as e:  # noqa: B036 (DCP's CheckpointException is a BaseException)
            if not self._future.done():  # timeout_s passed (TimeoutError) or the wait was interrupted
                raise
            _forget(self)
            lost = explain(e, f"the background save of {self.path}")  # a peer died or stopped: say which
            if lost is not None:
                raise lost from None
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"the background save of {self.path} failed ({cause(e)}); the previous "
                                  "checkpoint is unchanged") from e
        _forget(self)
        return self.path

    def __repr__(self) -> str:
        return f"PendingSave({str(self.path)!r}, done={self.done()})"


def cause(e: BaseException) -> str:
    """One line per failing rank: DCP's ``CheckpointException`` carries each rank's exception in
    ``failures``."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(f"rank {rank}: {type(pair[0]).__name__}: {str(pair[0])[:200]}"
                         for rank, pair in sorted(failures.items()))
    return f"{type(e).__name__}: {str(e)[:300]}"


def _forget(pending: PendingSave) -> None:
    with _LOCK:
        if pending in _PENDING:
            _PENDING.remove(pending)


def wait_pending() -> None:
    """Wait for every checkpoint still being written by this process; raises the first one's error
    (``CheckpointError``) after waiting for all of them. Not a collective by itself, but each write's last
    steps are: call it on every rank."""
    first = None
    while True:
        with _LOCK:
            if not _PENDING:
                break
            pending = _PENDING[0]
        try:
            pending.wait()
        except CheckpointError as e:
            first = first or e
    if first is not None:
        raise first


def release() -> None:
    """``wait_pending()``, then drop the checkpoint process group (the next asynchronous save makes a new
    one): called before ``destroy_process_group()``, so no process-group object outlives its default group
    into interpreter exit (the cause of the abort at exit measured in issue 13)."""
    global _GROUP
    try:
        wait_pending()
    finally:
        _GROUP = None


def _wait_at_exit() -> None:
    try:
        wait_pending()
    except CheckpointError as e:
        print(f"perparam.checkpoint: {e}", file=sys.stderr, flush=True)


def checkpoint_group() -> dist.ProcessGroup | None:
    """The gloo process group over all ranks that background writes use (``None`` without a default
    group), with the default group's timeout; created on the first call under the current default group,
    a collective then."""
    global _GROUP
    if not dist.is_initialized():
        return None
    world = dist.group.WORLD
    if _GROUP is None or _GROUP[0] is not world:
        _GROUP = (world, dist.new_group(backend="gloo", timeout=_timeout_of(world)))
    return _GROUP[1]


def _timeout_of(group: dist.ProcessGroup):
    """The timeout ``group`` was created with (``init_process_group(timeout=...)``), so a write whose peer
    died fails as soon as training would, not after gloo's 30-minute default; ``None`` (torch's default)
    where this torch does not expose it."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return None


def snapshot(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A CPU copy of every tensor of ``state`` (DTensors keep their spec: mesh, placements, global shape and
    stride; their local tensors are the CPU copies, whatever the mesh's device);
    training may change the originals as soon as this returns."""
    out = {}
    for key, value in state.items():
        if isinstance(value, DTensor):
            # the CPU copy wrapped as it is, with the original's spec: DTensor.from_local would move it back
            # to the mesh's device (a second device copy of the whole state on CUDA). torch's own CPU state
            # dicts of DTensors do the same (torch/distributed/_state_dict_utils.py, _create_cpu_state_dict)
            local = value.to_local().detach().to("cpu", copy=True)
            out[key] = DTensor(local, value._spec, requires_grad=False)
        else:
            out[key] = value.detach().to("cpu", copy=True)
    return out


def submit(write: Callable[[], Path], path: Path) -> PendingSave:
    """Run ``write`` on the checkpoint thread (one per process, so writes never overlap) and track it."""
    global _EXECUTOR
    with _LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="perparam-checkpoint")
            atexit.register(_wait_at_exit)
        pending = PendingSave(path, _EXECUTOR.submit(write))
        _PENDING.append(pending)
    return pending
