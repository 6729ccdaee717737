"""Whether a benchmark job fits in this machine's memory, decided before it starts (no OOM killer).

A configuration's bytes per rank are its model state by the ZeRO formulas (``perparam/memory/formulas.py``;
fp32 weights and gradients, AdamW: P = G = 4, O = 8 bytes per element): ``bound`` and ``ddp`` hold
``P + G + O`` whole (DDP plus its gradient buckets, a second copy of G: ``gradient_as_bucket_view=False``),
the sharded configurations ``(P + G + O) / K``. A job builds its configurations side by side in each of its K
processes, so it needs, over all ranks:

    K x (sum of the configurations' state x (1 + SLACK) + PER_RANK)

``SLACK`` covers the allocator's kept heap and the transient unsharded groups and gradients (the 27.4M
benchmark peaks at 1.2-1.6x its state over the baseline); ``PER_RANK`` the interpreter, torch and gloo
(~213 MiB) and the activations. The job fits when that is at most ``MemAvailable`` (``/proc/meminfo``)
less a reserve for the machine's other users. An estimate on purpose on the high side: the measured
training-phase peaks (``benchmarks/scaling.py`` prints both) show how far.
"""

from __future__ import annotations

from pathlib import Path

from perparam.memory.formulas import BytesPerParam, stage_memory

FP32_ADAMW = BytesPerParam(params=4, grads=4, optimizer=8)
UNSHARDED = ("bound", "ddp")
SLACK = 0.25
PER_RANK = 768 << 20  # bytes
GB = 10**9


def state_bytes_per_rank(name: str, num_params: int, world: int) -> int:
    """Model-state bytes one rank of configuration ``name`` holds after a step (the ZeRO formulas; DDP's
    gradient buckets included)."""
    if name in UNSHARDED:
        state = stage_memory("DDP", num_params, world, FP32_ADAMW).total
        return int(state + (FP32_ADAMW.grads * num_params if name == "ddp" else 0))
    return int(stage_memory("ZeRO-3", num_params, world, FP32_ADAMW).total)


def job_bytes(names: list[str], num_params: int, world: int) -> int:
    """Bytes a job building ``names`` side by side on ``world`` ranks needs, over all ranks."""
    per_rank = sum(state_bytes_per_rank(n, num_params, world) for n in names) * (1 + SLACK) + PER_RANK
    return int(world * per_rank)


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> int:
    """``MemAvailable`` in bytes. Raises ``OSError`` where ``/proc/meminfo`` has no such line."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise OSError(f"no MemAvailable line in {meminfo}")


def fitting(names: list[str], num_params: int, world: int, available: int,
            keep: tuple[str, ...] = ("perparam",)) -> tuple[list[str], dict[str, str]]:
    """The configurations of ``names`` (in their order) that fit side by side in ``available`` bytes, and
    a reason per one left out (``"skipped: needs X GB ..."``).

    Those in ``keep`` are taken first, then the others from the smallest state up while the job still fits,
    so the largest ones (``ddp``, ``bound``) are the ones dropped. A ``keep`` configuration that does not
    fit is skipped like the others (the caller then has nothing to compare)."""
    chosen: list[str] = []
    skipped: dict[str, str] = {}
    others = sorted((n for n in names if n not in keep),
                    key=lambda n: state_bytes_per_rank(n, num_params, world))
    for name in [n for n in names if n in keep] + others:
        need = job_bytes(chosen + [name], num_params, world)
        if need <= available:
            chosen.append(name)
            continue
        alone = state_bytes_per_rank(name, num_params, world) * world / GB
        skipped[name] = (f"skipped: needs {need / GB:.1f} GB with {', '.join(chosen) or 'nothing else'} on "
                         f"{world} ranks ({alone:.1f} GB of model state itself), {available / GB:.1f} GB "
                         "available")
    return [n for n in names if n in chosen], skipped


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children, their children, ...), from ``/proc/*/stat``."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parent[int(stat.parent.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    out, frontier = [], [pid]
    while frontier:
        kids = [p for p, pp in parent.items() if pp in frontier]
        out += kids
        frontier = kids
    return out


class MemoryGuard:
    """While active, a thread reads ``MemAvailable`` every ``interval`` seconds; when it falls below
    ``floor`` bytes it kills this process's descendants (the job's ranks and their forkserver) with
    SIGKILL, before the kernel's OOM killer picks a process of the machine's other users. ``tripped`` then
    holds the reason; the job's launcher sees its ranks die and raises."""

    def __init__(self, floor: int, interval: float = 0.5) -> None:
        self.floor, self.interval = floor, interval
        self.tripped: str | None = None
        self.lowest: int | None = None

    def __enter__(self) -> MemoryGuard:
        import threading

        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import os
        import signal

        while not self._stop.wait(self.interval):
            available = mem_available()
            self.lowest = available if self.lowest is None else min(self.lowest, available)
            if available < self.floor and self.tripped is None:
                self.tripped = (f"killed: MemAvailable fell to {available / GB:.1f} GB, under the "
                                f"{self.floor / GB:.1f} GB floor")
                for pid in _descendants(os.getpid()):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
