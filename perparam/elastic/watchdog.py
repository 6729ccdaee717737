"""``StepWatchdog``: a rank that stops (SIGSTOP, a debugger) or hangs (a blocked collective) is found within
a bound, not after the process group's timeout (gloo's default: 30 minutes).

Each rank runs one thread that, every ``perparam.comm.peers.BEAT_S`` seconds (0.25), posts a heartbeat in
the default store (``beat/<rank>``: a count; ``steps/<rank>``: the steps done) and checks the time since
this rank's last ``step()``. Past the bound it asks which peer is at fault:

- a peer on this host whose process is stopped (``/proc``), or on another host whose heartbeat stopped:
  it is stopped. A stopped process on this host is killed (SIGKILL: the same path as a process killed
  from outside, so under ``torchrun --max-restarts`` / ``perparam finetune --max-restarts`` the agent
  restarts the group); the survivors' collectives then fail and raise ``perparam.PeerLostError`` naming
  it. A stopped peer on another host cannot be killed from here: this rank leaves (exit 1), so its own
  agent restarts the group.
- every peer runs: a blocked collective (ranks that issued different collectives, a hang in user code).
  The ranks with the fewest steps done are the ones stuck (a rank that finished the step waits for them
  in the next); they leave (exit 1), which ends the others' waits as a dead peer's would.

One line (stderr, by the first survivor to claim it in the store) says which rank, on which host and pid, was
stopped and why; the same text is posted in the store, and each survivor's ``PeerLostError`` carries it.

The bound: ``timeout`` seconds when given; else ``max(factor x median step time, floor)`` over the last
``window`` steps, and ``first_timeout`` until ``warmup`` steps are measured (the first steps compile,
load, warm caches). ``paused()`` lifts it to ``first_timeout`` for a known long phase (an evaluation, a
checkpoint write). Cost while nothing fails: one store ``set`` per beat on a thread, nothing per step but
a clock read (measured: ``benchmarks/watchdog_step.py``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import statistics
import sys
import threading
import time

import torch.distributed as dist

from ..comm import peers

#: exit status of a rank that leaves because a peer on another host stopped or every rank is stuck
EXIT_CODE = 1


class StepWatchdog:
    """Watch this rank's steps (see the module docstring). Every rank creates one after
    ``init_process_group`` (and calls ``step()`` after each optimizer step); ``close()`` (or the end of a
    ``with`` block) stops its thread.

    ``timeout``: the bound in seconds (None: derived, ``max(factor x median step, floor)``); ``factor``,
    ``floor``, ``window``, ``warmup``, ``first_timeout``: the derivation (seconds, steps). ``on_expire``:
    called with the one line instead of acting (tests; the default kills or leaves as described)."""

    def __init__(self, timeout: float | None = None, *, factor: float = 8.0, floor: float = 10.0,
                 window: int = 20, warmup: int = 2, first_timeout: float = 300.0, on_expire=None) -> None:
        if timeout is not None and not timeout > 0:
            raise ValueError(f"StepWatchdog(timeout={timeout}): the bound must be a positive number of "
                             "seconds (None: derived from the measured step time)")
        self.timeout, self.factor, self.floor = timeout, factor, floor
        self.window, self.warmup, self.first_timeout = window, warmup, first_timeout
        self.on_expire = on_expire
        self.steps = 0
        self.durations: list[float] = []
        self.last = time.monotonic()
        self._paused = 0
        self._stop = threading.Event()
        self.expired: str | None = None
        self.beat_cpu_s = 0.0  # CPU seconds the heartbeat thread has used (time.thread_time, read in it)
        peers.register()
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self._thread = threading.Thread(target=self._run, daemon=True, name="perparam-watchdog")
        if self.world > 1:
            self._thread.start()

    # -- the training thread -----------------------------------------------------------------------------
    def step(self) -> None:
        """One step done (after the optimizer step): a clock read and a list append."""
        now = time.monotonic()
        self.durations.append(now - self.last)
        del self.durations[:-self.window]
        self.last = now
        self.steps += 1

    def bound(self) -> float:
        """Seconds a step may take now."""
        if self._paused or (self.timeout is None and self.steps < self.warmup):
            return max(self.first_timeout, self.timeout or 0.0)
        if self.timeout is not None:
            return self.timeout
        return max(self.factor * statistics.median(self.durations[-self.window:]), self.floor)

    @contextlib.contextmanager
    def paused(self):
        """A known long phase (evaluation, a checkpoint write): the bound is ``first_timeout`` meanwhile,
        and the phase does not count as a step."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self.last = time.monotonic()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * peers.BEAT_S + 3)

    def __enter__(self) -> StepWatchdog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        store = peers.store()
        beat = 0
        while not self._stop.wait(peers.BEAT_S):
            beat += 1
            try:
                if len(peers.roster()) < self.world:  # every peer's host and pid, before any is needed
                    peers.register()
                if store is not None:
                    store.set(f"beat/{self.rank}", str(beat))
                    store.set(f"steps/{self.rank}", str(self.steps))
            except Exception:  # noqa: BLE001 (a store that stopped answering: the check below still runs)
                pass
            self.beat_cpu_s = time.thread_time()
            waited = time.monotonic() - self.last
            bound = self.bound()
            if waited > bound and self.expired is None:
                self._expire(waited, bound)

    def _why(self, waited: float, bound: float) -> str:
        how = "set" if self.timeout is not None and not self._paused else (
            "before the steps were measured" if self._paused or self.steps < self.warmup else
            f"{self.factor:g} x the median step {statistics.median(self.durations[-self.window:]):.3f} s, "
            f"floor {self.floor:g} s")
        return f"no step for {waited:.1f} s, over the step watchdog's bound of {bound:.1f} s ({how})"

    def _expire(self, waited: float, bound: float) -> None:
        if waited < 2 * bound and peers.verdict() is not None:
            # a peer's watchdog already found the fault and acted (the stopped rank it killed may still be
            # tearing down, seen as running here): this rank's collective fails next, as PeerLostError
            return
        lost, _ = peers.find_lost(wait_s=0.0 if not self._remote() else 3 * peers.BEAT_S)
        host = socket.gethostname()
        table = peers.roster()
        why = self._why(waited, bound)
        dead = [r for r, what in lost if what.endswith("process gone")]
        lost = [(r, what) for r, what in lost if r not in dead]
        if dead and not lost:  # a dead peer this rank's wait did not notice: nothing to kill; leave
            names = ", ".join(f"rank {r} (host {table.get(r, ('?',))[0]}, pid {table.get(r, ('?', '?'))[1]})"
                              for r in dead)
            line = (f"perparam: {names} {'is' if len(dead) == 1 else 'are'} gone and rank {self.rank} still "
                    f"waits: {why}; it leaves so that the group ends or restarts")
            self.expired = line
            if self.on_expire is not None:
                return self.on_expire(line)
            os.write(2, (line + "\n").encode())
            return self._leave()
        if lost:
            names = ", ".join(f"rank {r} (host {table.get(r, ('?',))[0]}, pid {table.get(r, ('?', '?'))[1]})"
                              for r, _ in lost)
            line = (f"perparam: {names} {'was' if len(lost) == 1 else 'were'} stopped: rank {self.rank} saw "
                    f"{why}; "
                    + ("killed it" if all(table.get(r, ("",))[0] == host for r, _ in lost) else
                       "it is on another host: the ranks leave so that the group restarts"))
            self.expired = line
            if self.on_expire is not None:
                return self.on_expire(line)
            gone = {r for r, _ in lost}
            peers.post_verdict(line, share=0 not in gone)  # rank 0 may hold the store
            if self._first_to_say(gone):
                os.write(2, (line + "\n").encode())
            far = False
            for r, _ in lost:
                entry = table.get(r)
                if entry is not None and entry[0] == host:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(entry[1], signal.SIGKILL)
                else:
                    far = True
            if far:
                self._leave()
            return
        steps = self._steps_done()
        fewest = min(steps.values()) if steps else self.steps
        line = (f"perparam: rank {self.rank} (host {host}, pid {os.getpid()}) is stuck in step "
                f"{self.steps + 1}: {why}; every peer runs (a blocked collective: ranks that issued "
                "different collectives, or a hang in the training loop); it leaves so that the group ends or "
                "restarts")
        if self.steps > fewest:  # a peer is further behind: it is the one stuck, and leaves itself
            return
        self.expired = line
        if self.on_expire is not None:
            return self.on_expire(line)
        peers.post_verdict(line)
        os.write(2, (line + "\n").encode())
        self._leave()

    def _first_to_say(self, gone: set[int]) -> bool:
        """Whether this rank says the line: the first to claim it in the store, else (rank 0, which may host
        the store, is among ``gone``) the lowest surviving rank."""
        store = peers.store() if 0 not in gone else None
        if store is not None:
            with contextlib.suppress(Exception):
                return store.compare_set("said", "", str(self.rank)).decode() == str(self.rank)
        return self.rank == min(r for r in range(self.world) if r not in gone)

    def _remote(self) -> bool:
        host = socket.gethostname()
        return any(h != host for r, (h, _) in peers.roster().items() if r != self.rank)

    def _steps_done(self) -> dict[int, int]:
        store = peers.store()
        out = {}
        with contextlib.suppress(Exception):
            for r in range(self.world):
                if store is not None and store.check([f"steps/{r}"]):
                    out[r] = int(store.get(f"steps/{r}").decode())
        return out

    def _leave(self) -> None:
        sys.stderr.flush()
        os._exit(EXIT_CODE)
