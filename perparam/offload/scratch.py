"""The disk tier's scratch folder: one per process and user-named directory, removed at exit.

Each process makes ``perparam-offload-<pid>-<random>/`` inside the directory the user named and holds an
exclusive ``flock`` on its ``.lock`` file while it lives. At the next start, any such folder whose lock
can be taken belongs to a process that is gone (killed, crashed): it is removed. A lock, not a pid, so a
pid reused by an unrelated process does not keep a stale folder alive.
"""

from __future__ import annotations

import atexit
import fcntl
import multiprocessing.util
import os
import shutil
import tempfile
import time
from pathlib import Path

PREFIX = "perparam-offload-"
_STARTING = ".perparam-offload-starting-"
#: a folder without its lock file younger than this may still be starting up (seconds)
_STARTING_S = 60.0


class ScratchError(OSError):
    """The directory cannot hold the disk tier (missing permissions, not a directory, full)."""


def clean_stale(root: Path) -> list[Path]:
    """Remove the scratch folders under ``root`` no live process holds; returns those removed."""
    removed = []
    for child in root.glob(f"{_STARTING}*"):  # a process killed while it made its folder
        try:
            if time.time() - child.stat().st_mtime > _STARTING_S:
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child)
        except OSError:
            pass
    for child in root.glob(f"{PREFIX}*"):
        if not child.is_dir():
            continue
        lock = child / ".lock"
        try:
            fd = os.open(lock, os.O_RDWR)
        except FileNotFoundError:
            fd = None  # not made by a Scratch (its folders are locked before they get this name)
        except OSError:
            continue
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # alive
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
        finally:
            if fd is not None:
                os.close(fd)
    return removed


class Scratch:
    """This process's scratch folder under ``root`` (created, locked, checked writable)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root).expanduser().absolute()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            clean_stale(self.root)
            # locked before it takes its visible name, so no other process's clean_stale can take it for stale
            starting = Path(tempfile.mkdtemp(prefix=f"{_STARTING}{os.getpid()}-", dir=self.root))
            self._lock_fd = os.open(starting / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.dir = self.root / (PREFIX + starting.name[len(_STARTING):])
            os.rename(starting, self.dir)
        except OSError as e:
            raise ScratchError(e.errno,
                               f"cannot use {self.root} for the disk tier: {e.strerror or e}") from None
        self._pid = os.getpid()
        self._count = 0
        atexit.register(self.remove)
        # a multiprocessing child leaves through os._exit, past atexit: its finalizers run instead
        multiprocessing.util.Finalize(None, self.remove, exitpriority=10)

    def new_path(self, label: str) -> Path:
        """A new file name in the folder for ``label`` (a parameter name and what it holds)."""
        self._count += 1
        safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in label)[:120]
        return self.dir / f"{self._count:06d}-{safe}.bin"

    def remove(self) -> None:
        """Delete the folder (at exit; only in the process that made it, not in a forked child)."""
        if os.getpid() != self._pid or self._lock_fd < 0:
            return
        shutil.rmtree(self.dir, ignore_errors=True)
        try:
            os.close(self._lock_fd)
        except OSError:
            pass
        self._lock_fd = -1


_SCRATCH: dict[tuple[int, Path], Scratch] = {}


def scratch_for(root: str | os.PathLike) -> Scratch:
    """The process's ``Scratch`` under ``root`` (made on first use). Raises ``ScratchError``."""
    key = (os.getpid(), Path(root).expanduser().absolute())
    if key not in _SCRATCH:
        _SCRATCH[key] = Scratch(root)
    return _SCRATCH[key]
