"""Where a job's snapshots live on a node: one folder per job and node in host shared memory, two slot
files per rank for its own state and two for the replica it holds of another rank's.

``<root>/<job>[/<node>]/r<origin>-own-s<slot>``: rank ``origin``'s own snapshot, slot ``generation % 2``;
``.../r<origin>-by<holder>-s<slot>``: the replica of rank ``origin``'s snapshot that rank ``holder``
received. ``root`` is ``$PERPARAM_SNAPSHOT_DIR``, else ``/dev/shm/perparam-snapshots`` (tmpfs: memory of
the node, not disk). ``job`` is the elastic run id (``$TORCHELASTIC_RUN_ID``, the same for every restart of
a job), else the agent's pid, so that two jobs on one node never share slots.

``node`` (``node_name``): the node's own namespace, one per elastic agent: ``$PERPARAM_SNAPSHOT_NODE``, else
under torch's elastic agent ``<host>-agent<pid of the agent>``, the same for every restart of the workers
that agent makes. What a node's ranks write is read back only by that node's ranks (the other nodes get
it through the replicas they hold), so two agents on one host (nodes simulated on one machine) lose their
memory as two machines would: a killed agent's folder is never read again, and it is removed with the
job's at the job's end. Outside an agent (no ``$TORCHELASTIC_RUN_ID``) there is no node folder.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from pathlib import Path

from .errors import SnapshotError
from .slots import HEADER_BYTES, Header, SlotFile, read_header

ROOT_ENV = "PERPARAM_SNAPSHOT_DIR"
NODE_ENV = "PERPARAM_SNAPSHOT_NODE"
DEFAULT_ROOT = "/dev/shm/perparam-snapshots"
NAME = re.compile(r"r(\d+)-(own|by\d+)-s([01])")
#: the other files a job keeps beside its slots, ``perparam finetune``'s: why its workers stopped (one line)
#: and when each learnt its group stops; with the slot files, the only files :func:`remove` deletes
STOPPED_FILE, STOPS_FILE = "stopped", "stops"
JOB_FILES = (STOPPED_FILE, STOPS_FILE)


def default_job() -> str:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return run_id
    return f"agent{os.getppid()}"


def job_folder(job: str | None = None, root: str | os.PathLike | None = None) -> Path:
    """``<root>/<job>``: every node's folder of the job on this host (what the job's end removes). Raises
    ``SnapshotError`` for a ``job`` that is not one folder name (empty, ``.``, ``..``, a path separator)."""
    name = folder_name(default_job() if job is None else job, "job")
    return Path(root or os.environ.get(ROOT_ENV) or DEFAULT_ROOT) / name


def folder_name(name: str, what: str) -> str:
    """``name`` when it names one folder inside another; else ``ValueError`` naming ``what`` (a job name
    such as ``..`` would put the snapshots, and the removal at the job's end, outside the job's folder):
    ``SnapshotError``."""
    if (not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name
            or (os.altsep and os.altsep in name) or "\0" in name):
        raise SnapshotError(f"{what}={name!r}: a snapshot {what} is one folder name (no '/', not '.' or "
                            "'..', not empty); its folder is removed at the job's end")
    return name


def node_name() -> str | None:
    """This node's namespace in a job's folder (module docstring), or None outside torch's elastic agent."""
    named = os.environ.get(NODE_ENV)
    if named:
        return folder_name(named, NODE_ENV)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id or run_id == "none":
        return None
    return f"{socket.gethostname()}-agent{agent_pid()}"


def agent_pid() -> int:
    """The pid of the elastic agent that started this worker: the parent of this process's session leader
    (the agent starts each worker in a session of its own, so a wrapper such as ``torchrun --no-python
    bash run.sh`` between the two does not change it); the parent pid where ``/proc`` cannot tell."""
    sid = os.getsid(0)
    if sid == os.getpid():
        return os.getppid()
    try:
        return int(Path(f"/proc/{sid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return os.getppid()


def node_folder(job: Path) -> Path:
    """The folder this node's ranks write to and read from: ``job/<node>``, or ``job`` outside an agent."""
    node = node_name()
    return job / node if node else job


class Store:
    """This rank's slot files in ``folder`` (created with mode 0700)."""

    def __init__(self, folder: Path, rank: int) -> None:
        self.folder, self.rank = Path(folder), rank
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._own: dict[int, SlotFile] = {}
        self._held: dict[tuple[int, int], SlotFile] = {}

    def own(self, slot: int) -> SlotFile:
        if slot not in self._own:
            self._own[slot] = SlotFile(self.folder / f"r{self.rank}-own-s{slot}")
        return self._own[slot]

    def held(self, origin: int, slot: int) -> SlotFile:
        """The slot where this rank keeps its replica of rank ``origin``'s snapshot."""
        if (origin, slot) not in self._held:
            self._held[(origin, slot)] = SlotFile(self.folder / f"r{origin}-by{self.rank}-s{slot}")
        return self._held[(origin, slot)]

    def bytes_mapped(self) -> int:
        return sum(s.capacity for s in [*self._own.values(), *self._held.values()])

    def close(self) -> None:
        for s in [*self._own.values(), *self._held.values()]:
            s.close()
        self._own.clear()
        self._held.clear()


def scan(folder: Path) -> tuple[list[tuple[Path, Header]], list[str]]:
    """The slot files in ``folder`` whose header is whole (the payload is checked later, by ``Slot.verify``),
    sorted by name; and the names of those whose header is damaged (not whole, and not zeroed either: a
    zeroed header is a slot that was being written)."""
    found, damaged = [], []
    if not folder.is_dir():
        return found, damaged
    for path in sorted(folder.iterdir()):
        m = NAME.fullmatch(path.name)
        if not m:
            continue
        header = read_header(path)
        if header is not None and header.origin == int(m.group(1)):
            found.append((path, header))
        elif header is None and any(zeroed_or_short(path)):
            damaged.append(path.name)
    return found, damaged


def zeroed_or_short(path: Path) -> list[bool]:
    """``[True]`` when ``path``'s header bytes are neither all zero nor missing (a damaged header)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except OSError:
        return []
    return [len(raw) == HEADER_BYTES and any(raw)]


def remove(folder: Path) -> None:
    """Remove a job's snapshots (at the job's successful end): the slot files and :data:`JOB_FILES` in
    ``folder`` and in its node folders, then each folder left empty. Nothing else is deleted: a file of
    another kind (a folder the user chose as ``root``/``job`` that held files of their own) stays, and so
    does the folder holding it."""
    subs = sorted(p for p in folder.iterdir() if p.is_dir() and not p.is_symlink()) if folder.is_dir() else []
    for sub in subs:
        clear(sub)
        with contextlib.suppress(OSError):
            sub.rmdir()
    clear(folder)
    with contextlib.suppress(OSError):
        folder.rmdir()


def clear(folder: Path) -> None:
    """Delete the slot files and :data:`JOB_FILES` directly in ``folder`` (nothing else)."""
    for path in folder.iterdir() if folder.is_dir() else ():
        if (NAME.fullmatch(path.name) or path.name in JOB_FILES) and (path.is_symlink() or path.is_file()):
            path.unlink(missing_ok=True)
