"""The fault harness of a user's own script: ``benchmarks/harness/fault_worker.py`` on K ranks, one of them
SIGKILLed or SIGSTOPped from outside in a given phase, and what each rank then printed, its exit status, and
the seconds from the signal to the first line of each survivor's error (``benchmarks/peer_faults.py``, and
the tests of what a user sees: ``tests/test_lost_peers.py``, ``tests/test_step_watchdog.py``).

``run_fault(world, phase, signal, victim=1, at=2, watchdog=None)`` returns a ``Fault``. Every process it
started is gone when it returns (a stopped one is killed; ``Fault.left_stopped`` says whether one still
was).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Fault:
    codes: list  # exit status per rank (negative: killed by that signal)
    out: list  # stdout per rank
    err: list  # stderr per rank
    victim_pid: int
    #: per rank: seconds from the signal to its first stderr line (None: none)
    detected_s: list = field(default_factory=list)
    left_stopped: bool = False
    ckpt: str = ""
    #: per rank: seconds from the signal to its exit (None: killed by the harness at the timeout)
    exited_s: list = field(default_factory=list)

    def error_line(self, rank: int) -> str:
        """The last non-empty stderr line of ``rank`` (Python's last traceback line: the error)."""
        lines = [x for x in self.err[rank].splitlines() if x.strip()]
        return lines[-1] if lines else ""


def _reader(stream, sink: list, stamps: list) -> None:
    for line in iter(stream.readline, ""):
        stamps.append(time.monotonic())
        sink.append(line)


def run_fault(world: int, phase: str, sig: int, victim: int = 1, at: int = 2, watchdog: float | None = None,
              timeout: float = 240.0) -> Fault:
    from datetime import timedelta

    import torch.distributed as dist

    # the store is hosted here, as torchrun's agent hosts it (port 0: the kernel picks a free one, no race)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    ckpt = tempfile.mkdtemp(prefix="perparam-fault-")
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
           "TORCHELASTIC_USE_AGENT_STORE": "True", "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1",
           "GLOO_SOCKET_IFNAME": "lo"}
    argv = [sys.executable, "-m", "benchmarks.harness.fault_worker", phase, str(victim), str(at), ckpt]
    if watchdog is not None:
        argv.append(str(watchdog))
    procs, outs, errs, out_t, err_t = [], [], [], [], []
    for rank in range(world):
        p = subprocess.Popen(argv, cwd=REPO, env={**env, "RANK": str(rank)}, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        procs.append(p)
        outs.append([]), errs.append([]), out_t.append([]), err_t.append([])
        for stream, sink, stamps in ((p.stdout, outs[-1], out_t[-1]), (p.stderr, errs[-1], err_t[-1])):
            threading.Thread(target=_reader, args=(stream, sink, stamps), daemon=True).start()
    deadline = time.monotonic() + timeout
    sent = None
    exited: list = [None] * world  # seconds from the signal to each process's exit
    while time.monotonic() < deadline:
        if sent is None and any(line.startswith(f"in-{phase} ") for line in outs[victim]):
            # (a stop is sent at once: the watchdog's bound runs from the last step)
            if sig != signal.SIGSTOP:
                time.sleep(0.3)  # the survivors reach their wait
            procs[victim].send_signal(sig)
            sent = time.monotonic()
        for rank, p in enumerate(procs):
            if exited[rank] is None and p.poll() is not None:
                exited[rank] = time.monotonic() - (sent or time.monotonic())
        if all(x is not None for x in exited):
            break
        time.sleep(0.02)
    left_stopped = any(_state(p.pid) == "T" for p in procs if p.poll() is None)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    del store
    shutil.rmtree(ckpt, ignore_errors=True)  # its checkpoints: only the path is reported
    time.sleep(0.1)  # the readers drain
    detected = [(stamps[0] - sent) if (stamps and sent is not None) else None for stamps in err_t]
    return Fault([p.returncode for p in procs], ["".join(o) for o in outs], ["".join(e) for e in errs],
                 procs[victim].pid, detected, left_stopped, ckpt, exited)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"

