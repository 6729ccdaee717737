"""Resident memory of this process (Linux ``/proc``): current, high-water mark, its reset, and a sampler
that follows ``VmRSS`` through one training step.

``reset_peak()`` writes 5 to ``/proc/self/clear_refs``, which sets ``VmHWM`` to the current ``VmRSS``
(proc(5)); the peak of the training phase is then ``VmHWM`` read after the steps. All figures in bytes.
"""

from __future__ import annotations

import ctypes
import gc
import threading
import time
from pathlib import Path


def vm_status() -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":", 1)[0]
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(line.split()[1]) * 1024  # kB
    return out


def trim() -> None:
    """Collect garbage and hand freed heap back to the OS (``malloc_trim``), so RSS after a build is what
    the build keeps, not what glibc cached."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def set_mmap_threshold(nbytes: int) -> None:
    """``mallopt(M_MMAP_THRESHOLD, nbytes)``: glibc then maps every allocation of ``nbytes`` or more on its
    own and unmaps it when freed, so freed tensors leave the resident set at once (by default the
    threshold rises up to 32 MiB as large blocks are freed, and those then stay in glibc's heap). What
    resident memory then shows is close to what is live; each such allocation is page-faulted in anew
    (more CPU). Raises ``OSError`` where glibc is not present or refuses the value."""
    if ctypes.CDLL("libc.so.6").mallopt(-3, int(nbytes)) != 1:  # M_MMAP_THRESHOLD
        raise OSError(f"mallopt(M_MMAP_THRESHOLD, {nbytes}) failed")


def reset_peak() -> None:
    """Make ``VmHWM`` equal the current ``VmRSS``. Raises ``OSError`` where ``/proc/self/clear_refs`` cannot
    be written (not Linux)."""
    Path("/proc/self/clear_refs").write_text("5")


class RssSampler:
    """Reads ``VmRSS`` every ``interval`` seconds on a thread while active; ``mark(phase)`` labels the
    samples that follow. ``summary()`` gives, per phase in order: RSS at its start, its peak, at its end.

    The sampler thread runs while torch computes (torch releases the GIL in its kernels); a phase shorter
    than ``interval`` may show only its boundary readings."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.samples: list[tuple[str, int]] = []
        self.phase = "start"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> int:
        return vm_status()["VmRSS"]

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((self.phase, self._read()))
            time.sleep(self.interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append((self.phase, self._read()))

    def mark(self, phase: str) -> None:
        """Label the following samples ``phase``; takes a reading at the boundary."""
        self.samples.append((self.phase, self._read()))
        self.phase = phase
        self.samples.append((phase, self._read()))

    def summary(self) -> list[dict]:
        out: list[dict] = []
        for phase, rss in self.samples:
            if not out or out[-1]["phase"] != phase:
                out.append({"phase": phase, "start": rss, "peak": rss, "end": rss, "samples": 0})
            rec = out[-1]
            rec["peak"] = max(rec["peak"], rss)
            rec["end"] = rss
            rec["samples"] += 1
        return out
