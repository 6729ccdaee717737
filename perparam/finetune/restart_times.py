"""When each start of a worker group got where: the wall-clock times (``time.time()``, seconds since the
epoch) a benchmark subtracts from the moment it killed a worker, to split the seconds from a fault to the
first step after it into detection, restart and restore.

- ``started``: this worker process was created (``/proc/self/stat``'s start time on Linux, 10 ms ticks;
  elsewhere the import of this module): the agent's restart, or a user's relaunch, is done.
- ``ready``: the model is sharded and restored (from the in-memory snapshot, from ``--resume``'s checkpoint,
  or freshly initialised): the next line of work is the first step.
- ``first_step``: the first optimizer step of this start completed.
- ``detected`` (restarts only): the earliest moment a worker of the group that failed knew of the fault (its
  collective failed on the lost peer, or the agent told it to stop), as the survivors noted it
  (:func:`note_stop`) in the job's snapshot folder on this node; None when no survivor could note it (each
  was killed while blocked).
- ``restore_s``: ``State.restore()`` itself (restarts only).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from perparam.elastic.store import STOPS_FILE

#: the file, in the job's snapshot folder, where the workers of a failing group note when they stopped
_IMPORTED = time.time()


def process_started() -> float:
    """The wall-clock time this process was created (Linux: from ``/proc``, to a clock tick; elsewhere the
    import of this module)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    return _IMPORTED


def note_stop(folder: str | os.PathLike | None, rank: str, restart: int) -> None:
    """Append ``rank restart time`` to ``folder``'s stops file (one ``write``: safe in a signal handler
    and from several ranks at once); nothing when ``folder`` is None or cannot be written."""
    if folder is None:
        return
    line = f"{rank} {restart} {time.time():.6f}\n".encode()
    with contextlib.suppress(OSError):
        fd = os.open(os.path.join(folder, STOPS_FILE), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


def detected(folder: str | os.PathLike, restart: int) -> float | None:
    """The earliest stop noted by the workers of start ``restart`` (the group that failed), or None."""
    times = []
    with contextlib.suppress(OSError):
        for line in (Path(folder) / STOPS_FILE).read_text().splitlines():
            parts = line.split()
            with contextlib.suppress(ValueError, IndexError):
                if int(parts[1]) == restart:
                    times.append(float(parts[2]))
    return min(times) if times else None


class StartClock:
    """This start's marks: ``started`` at construction, then :meth:`ready` and :meth:`first_step` (each
    kept the first time it is called)."""

    def __init__(self) -> None:
        self.started = process_started()
        self.ready_at: float | None = None
        self.first_step_at: float | None = None

    def ready(self) -> None:
        if self.ready_at is None:
            self.ready_at = time.time()

    def first_step(self) -> None:
        if self.first_step_at is None:
            self.first_step_at = time.time()

    def record(self) -> dict:
        """``{"started", "ready", "first_step"}``: wall-clock seconds (None where not reached)."""
        return {"started": self.started, "ready": self.ready_at, "first_step": self.first_step_at}
