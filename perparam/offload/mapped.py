"""A tensor whose bytes live in a file: the disk tier's unit.

``Slot(scratch, label, tensor)`` copies ``tensor`` (a plain CPU tensor: a local shard or an optimizer
state tensor) into a new file of exactly its bytes (reserved up front with ``posix_fallocate``, so a disk
that fills up later cannot fail a write-back) and points ``tensor`` at a shared mapping of that file
(``tensor.set_``: the same tensor object, so optimizers, DTensors and state dicts keep their references).

Between uses the slot is *evicted*: dirty pages are written to the file (``sync_file_range``), unmapped from
the process (``MADV_DONTNEED``) and dropped from the page cache (``POSIX_FADV_DONTNEED``), so neither the
process's anonymous memory nor its file pages hold the bytes. Before use it is *fetched* on the
background I/O thread (``MADV_POPULATE_WRITE``: read from disk and mapped writable). Any access at any
other time is still correct: the kernel reads the missing pages from the file (slower, never wrong).

Two I/O threads per process ("lanes") run fetches and evictions, each in submission order; every job of
a slot runs on its lane, so a fetch after an eviction of the same slot sees the written bytes. Lane 0
carries the stored shards (read ahead of all-gathers), lane 1 optimizer state and gradients (written back
in bulk after the step and during backward), so a shard's read never queues behind those write-backs.
``STATS`` counts bytes and seconds (fetch time on the thread, time the training thread waited for fetches).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from .scratch import Scratch

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14
_PAGE = mmap.PAGESIZE


class OffloadError(RuntimeError):
    """The disk tier could not store or read a parameter's state; the message names the parameter, the
    file and the fix. Raised before anything is lost: the state stays in memory."""


class Stats:
    """Counters of the disk tier in this process (bytes; seconds)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.bytes_fetched = self.bytes_written = 0
        self.fetch_s = self.evict_s = self.wait_s = 0.0

    def add(self, **kw) -> None:
        with self.lock:
            for key, value in kw.items():
                setattr(self, key, getattr(self, key) + value)

    def as_dict(self) -> dict:
        return {k: getattr(self, k)
                for k in ("bytes_fetched", "bytes_written", "fetch_s", "evict_s", "wait_s")}


STATS = Stats()
_EXECUTORS: tuple[int, list[ThreadPoolExecutor]] | None = None
SHARD_LANE, STATE_LANE = 0, 1


def executor(lane: int = SHARD_LANE) -> ThreadPoolExecutor:
    """The process's I/O thread of ``lane`` (``SHARD_LANE`` or ``STATE_LANE``; made again in a forked
    child)."""
    global _EXECUTORS
    if _EXECUTORS is None or _EXECUTORS[0] != os.getpid():
        _EXECUTORS = (os.getpid(),
                      [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"perparam-offload-{i}")
                       for i in (SHARD_LANE, STATE_LANE)])
    return _EXECUTORS[1][lane]


_SYNC_FILE_RANGE = 1 | 2 | 4  # WAIT_BEFORE | WRITE | WAIT_AFTER: every dirty page written, no journal commit
_libc = None


def _write_back(fd: int, mm: mmap.mmap) -> None:
    """The mapping's dirty pages to the file: ``sync_file_range`` (data pages only: 3-5x cheaper than
    ``msync``'s journal commit for small files), else ``msync``. Raises ``OSError`` (a seam the tests use to
    inject ENOSPC)."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        except (OSError, AttributeError):
            _libc = False
    if not _libc:
        mm.flush()
        return
    if _libc.sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


class Slot:
    """One tensor's bytes in one file of the disk tier. ``label``: what it is, for messages
    (``"'blocks.0.fc1.weight' optimizer state 'exp_avg'"``). Raises ``OffloadError`` (naming the label
    and the file) when the file cannot be made; ``tensor`` is then unchanged. ``bind=False``: only
    reserve the file for tensors of ``tensor``'s dtype and shape (``GradSlot``). ``lane``: the I/O thread
    of its jobs (``SHARD_LANE`` for stored shards)."""

    def __init__(self, scratch: Scratch, label: str, tensor: torch.Tensor, bind: bool = True,
                 lane: int = STATE_LANE) -> None:
        self.label = label
        self.lane = lane
        self.nbytes = tensor.numel() * tensor.element_size()
        self.path: Path = scratch.new_path(label)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise self.error("create", e) from None
        try:
            os.posix_fallocate(fd, 0, self.nbytes)
            self.mm = mmap.mmap(fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise self.error("reserve", e) from None
        os.close(fd)
        self.dtype, self.shape, self.numel = tensor.dtype, tuple(tensor.shape), tensor.numel()
        self.pending: list[Future] = []
        self.resident = True
        weakref.finalize(self, _unlink, self.path)  # a model dropped mid-run leaves no file behind
        if bind:
            self.tensor = tensor
            self.ptr = self._point(tensor)

    def _point(self, tensor: torch.Tensor) -> int:
        """Copy ``tensor``'s values into the mapping and point ``tensor`` at it; returns its address."""
        mapped = torch.frombuffer(self.mm, dtype=self.dtype, count=self.numel).view(self.shape)
        with torch.no_grad():
            mapped.copy_(tensor)
            tensor.set_(mapped)
        return mapped.data_ptr()

    def error(self, what: str, e: OSError) -> OffloadError:
        hint = ("free space on that disk or name another directory in OffloadPolicy('disk', path=...)"
                if e.errno == 28 else "check the directory named in OffloadPolicy('disk', path=...)")
        return OffloadError(f"disk tier: could not {what} {self.label} in {self.path} ({self.nbytes} bytes): "
                            f"{e.strerror or e}; {hint}. Its state is kept in memory")

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` still is this slot's mapping (``load_state_dict`` or ``to_empty`` may have
        given it new storage)."""
        return (tensor is self.tensor and tensor.data_ptr() == self.ptr
                and tensor.numel() * tensor.element_size() == self.nbytes)

    # -- on the I/O thread -------------------------------------------------------------------------------
    def _fetch(self) -> None:
        t0 = time.perf_counter()
        try:
            self.mm.madvise(MADV_POPULATE_WRITE)
        except OSError:  # older kernels: touch one byte per page
            self.mm.madvise(mmap.MADV_WILLNEED)
            bytes(memoryview(self.mm)[::_PAGE])
        self.resident = True
        STATS.add(bytes_fetched=self.nbytes, fetch_s=time.perf_counter() - t0)

    def _evict(self, write: bool) -> None:
        t0 = time.perf_counter()
        try:
            fd = os.open(self.path, os.O_RDWR)
        except OSError as e:
            raise self.error("open", e) from None
        try:
            if write:
                try:
                    _write_back(fd, self.mm)
                except OSError as e:
                    raise self.error("write back", e) from None
            self.mm.madvise(mmap.MADV_DONTNEED)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages leave the page cache
        finally:
            os.close(fd)
        self.resident = False
        STATS.add(bytes_written=self.nbytes if write else 0, evict_s=time.perf_counter() - t0)

    # -- from the training thread ------------------------------------------------------------------------
    def fetch(self) -> None:
        """Read the bytes in ahead of use, on the I/O thread (no-op when the last queued job is a fetch, or
        when nothing is queued and the bytes are in)."""
        if self.pending and self.pending[-1].kind == "fetch" or not self.pending and self.resident:
            return
        self._submit("fetch", self._fetch)

    def evict(self, write: bool = True) -> None:
        """Write the bytes back (``write``) and drop them from memory, on the I/O thread."""
        self._submit("evict", self._evict, write)

    def _submit(self, kind: str, fn, *args) -> None:
        future = executor(self.lane).submit(fn, *args)
        future.kind = kind
        future.job = (fn, args)
        self.pending = [f for f in self.pending if not f.done() or f.exception() is not None] + [future]

    def wait(self) -> None:
        """Wait for this slot's queued I/O; re-raises the first ``OffloadError`` (the bytes stay in
        memory: an eviction that failed did not drop them). A job the I/O thread has not started yet runs
        here, in this slot's order, rather than waiting behind other slots' queued I/O (the one I/O thread
        runs jobs first in, first out)."""
        pending, self.pending = self.pending, []
        t0 = time.perf_counter()
        errors = []
        for future in pending:
            if future.cancel():
                fn, args = future.job
                try:
                    fn(*args)
                except OffloadError as e:
                    errors.append(e)
                continue
            error = future.exception()
            if error is not None:
                errors.append(error)
        STATS.add(wait_s=time.perf_counter() - t0)
        if errors:
            raise errors[0]


class GradSlot(Slot):
    """The file of one parameter's gradient shard: reserved once (at ``fully_shard``, ``like``: the local
    shard, whose dtype and shape the sharded ``.grad`` has) and given each new ``.grad`` tensor in turn
    (``zero_grad()`` drops the old one; the reduction makes a new one). The tensor is held weakly, so a
    dropped ``.grad`` frees nothing but its mapping."""

    def __init__(self, scratch: Scratch, label: str, like: torch.Tensor) -> None:
        super().__init__(scratch, label, like, bind=False)
        self._ref = None
        self.ptr = None

    @property
    def tensor(self) -> torch.Tensor | None:
        """The ``.grad``'s local tensor now in the file, or ``None`` (none given yet, or dropped)."""
        return self._ref() if self._ref is not None else None

    def holds(self, tensor: torch.Tensor) -> bool:
        return tensor is self.tensor and tensor.data_ptr() == self.ptr

    def take(self, values: torch.Tensor) -> torch.Tensor:
        """A new tensor in the file holding ``values`` (a new ``.grad``'s local tensor: this slot's dtype
        and shape), from now on the slot's. A new tensor rather than ``values`` repointed: ``values`` may
        be a view of the reduction's buffer, which a view keeps alive. The slot's queued I/O finishes first;
        the previous tensor, when still referenced elsewhere (a ``.grad`` kept by the caller), gets its own
        memory with its values, so it never changes under its holder."""
        self.wait()
        old = self.tensor
        if old is not None:
            with torch.no_grad():
                old.set_(old.clone())
        mapped = torch.frombuffer(self.mm, dtype=self.dtype, count=self.numel).view(self.shape)
        with torch.no_grad():
            mapped.copy_(values)
        self.ptr = mapped.data_ptr()
        self.resident = True
        self._ref = weakref.ref(mapped)
        return mapped
