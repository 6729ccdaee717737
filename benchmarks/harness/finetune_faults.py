"""The main job under real faults: ``perparam finetune`` (the tiny config, ``--invariant-units``, 4 ranks on
this node) with one worker SIGKILLed or SIGSTOPped from outside in a chosen phase of a chosen step
(``fault_traps.py`` holds it there), recovered two ways, each against the run that lost none:

- :func:`from_snapshot`: ``--max-restarts 1``: torch's agent restarts the group (same K), the new workers
  restore the in-memory snapshot; the job's ``restart_times`` record splits the seconds from the signal to
  the first completed step after it.
- :func:`from_disk`: ``--max-restarts 0``: the command fails, and is started again at once with
  ``--resume`` on its ``--save`` folder (what a user does by hand).

Each returns a dict: the exit status, the steps done and committed at the signal, the step continued from,
the steps lost and recomputed, the seconds (``detection``, ``restart``, ``restore``, ``first_step`` and
their ``total``, from the signal), and :func:`compare`'s verdict on the final bits (the losses, learning
rates, gradient norms, held-out losses, the GGUF and every parameter and AdamW tensor of the final
checkpoint, by sha256). Every process a case starts is gone when it returns.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness.fault_traps import PHASES, TRAP_ENV, site_folder

REPO = Path(__file__).resolve().parents[2]
SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGSTOP": signal.SIGSTOP}
#: what the fingerprint compares from the summary JSON
SUMMARY_KEYS = (
    "train_losses",
    "grad_norms",
    "heldout_losses",
    "lrs",
    "heldout_loss_before",
    "heldout_loss_after",
)
TEXT = """Shall I compare thee to a summer's day?
Thou art more lovely and more temperate:
Rough winds do shake the darling buds of May,
And summer's lease hath all too short a date;
"""


@dataclass(frozen=True)
class Job:
    """The job every case runs: ``nproc`` ranks, ``steps`` steps, a checkpoint every ``save_every``,
    ``bound``: ``--step-timeout`` (the watchdog's bound for a stopped rank, seconds)."""

    nproc: int = 4
    steps: int = 12
    save_every: int = 4
    units: int = 8
    bound: float = 5.0

    def argv(self, text: Path, out: Path, name: str, save: str | None = None) -> list[str]:
        return [
            "--config",
            "tiny",
            "--seq-len",
            "32",
            "--lr",
            "3e-3",
            "--eval-tokens",
            "128",
            "--text",
            str(text),
            "--nproc",
            str(self.nproc),
            "--invariant-units",
            str(self.units),
            "--batch-size",
            "8",
            "--steps",
            str(self.steps),
            "--max-grad-norm",
            "0.5",
            "--eval-every",
            "4",
            "--save",
            str(out / f"ck-{save or name}"),
            "--save-every",
            str(self.save_every),
            "--step-timeout",
            repr(self.bound),
            "--summary-json",
            str(out / f"{name}.json"),
            "--export",
            str(out / f"{name}.gguf"),
        ]


@dataclass(frozen=True)
class Case:
    """``signal`` (``SIGKILL``/``SIGSTOP``) of rank ``victim`` in ``phase`` of 1-based step ``step``."""

    signal: str
    victim: int
    phase: str
    step: int

    def __post_init__(self) -> None:
        if self.signal not in SIGNALS or self.phase not in PHASES:
            raise ValueError(f"{self}: signal one of {sorted(SIGNALS)}, phase one of {PHASES}")

    @property
    def name(self) -> str:
        return f"{self.signal.lower()}-r{self.victim}-{self.phase}"


def write_text(folder: Path) -> Path:
    """The job's text: a sonnet's quatrain as training text, reversed as held-out text."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a_train.txt").write_text(TEXT * 60)
    (folder / "b_heldout.txt").write_text(TEXT[::-1] * 20)
    return folder


class Launch:
    """One ``perparam finetune`` command in a subprocess; its output lines (workers' included) kept."""

    def __init__(self, argv: list[str], env: dict) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "perparam.cli", "finetune", *argv],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self.ended: float | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in iter(self.proc.stdout.readline, ""):
            self.lines.append(line)

    def wait(self, timeout: float) -> int:
        """The exit status (the command is killed past ``timeout`` seconds: status -9)."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        self.ended = self.ended or time.time()
        self._reader.join(timeout=5)
        return self.proc.returncode

    def poll_ended(self) -> bool:
        if self.ended is None and self.proc.poll() is not None:
            self.ended = time.time()
        return self.ended is not None

    def kill(self) -> None:
        """The launcher and every worker it started."""
        for pid in workers_of(self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()

    def progress(self) -> int | None:
        """Rank 0's steps done, from the launcher's progress file."""
        pattern = os.path.join(tempfile.gettempdir(), f"perparam-finetune-{self.proc.pid}-*", "progress")
        for path in glob.glob(pattern):
            with contextlib.suppress(OSError, ValueError, IndexError):
                return int(Path(path).read_text().split()[0])
        return None

    def tail(self, n: int = 30) -> str:
        return "".join(self.lines[-n:])


def workers_of(parent: int) -> list[int]:
    """The pids of ``parent``'s children (the agent's workers)."""
    found = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(Path(stat).read_text().rsplit(")", 1)[1].split()[1]) == parent:
                found.append(int(Path(stat).parent.name))
    return found


def environment(out: Path, name: str, trap: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", TRAP_ENV)}
    paths = [str(site_folder(out / "site"))] if trap else []
    env["PYTHONPATH"] = os.pathsep.join([*paths, str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["PERPARAM_SNAPSHOT_DIR"] = str(out / f"shm-{name}")
    if trap:
        env[TRAP_ENV] = trap
    return env


def committed(snapshots: Path) -> int | None:
    """The newest step every rank's own snapshot slot holds complete (header whole), or None (the slots lie
    in ``<root>/<job>/<node>/``: every folder under ``snapshots`` is read)."""
    from perparam.elastic.store import scan

    newest: dict[int, int] = {}
    for folder in (p for p in snapshots.rglob("*") if p.is_dir()):
        for path, header in scan(folder)[0]:
            if "-own-" in path.name:
                newest[header.origin] = max(newest.get(header.origin, 0), header.generation)
    return min(newest.values()) if newest else None


def fingerprint(out: Path, name: str, steps: int, checkpoint: str | None = None) -> dict:
    """What a run ends on: the summary's reported numbers, the GGUF's sha256 and the sha256 of every tensor of
    the final checkpoint (``model.*``, ``optim.*``)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    summary = json.loads((out / f"{name}.json").read_text())
    found = {k: summary.get(k) for k in SUMMARY_KEYS}
    found["gguf"] = hashlib.sha256((out / f"{name}.gguf").read_bytes()).hexdigest()
    flat = out / f"{name}-final.pt"
    dcp_to_torch_save(out / f"ck-{checkpoint or name}" / f"step-{steps:06d}", flat)
    tensors = torch.load(flat, weights_only=False)
    flat.unlink()
    found["tensors"] = {
        k: hashlib.sha256(v.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
        for k, v in tensors.items()
        if torch.is_tensor(v)
    }
    return found


def compare(got: dict, want: dict, resumed_at: int = 0) -> dict:
    """``{"params", "optimizer", "gguf", "reported": bool, "differing": [names]}``: equal bit for bit.
    ``resumed_at``: ``got`` is a run resumed from the checkpoint of that step, which reports only the steps
    after it (its held-out loss before: the uninterrupted run's at that step)."""
    differing = [k for k in want["tensors"] if got["tensors"].get(k) != want["tensors"][k]]
    differing += [k for k in got["tensors"] if k not in want["tensors"]]
    if resumed_at:
        evals = [e for e in want["heldout_losses"] if e[0] >= resumed_at]
        want = {
            **want,
            "train_losses": want["train_losses"][resumed_at:],
            "lrs": want["lrs"][resumed_at:],
            "grad_norms": want["grad_norms"][resumed_at:],
            "heldout_losses": evals,
            "heldout_loss_before": evals[0][1] if evals else None,
        }
    reported = [k for k in SUMMARY_KEYS if got[k] != want[k]]
    return {
        "params": not [k for k in differing if k.startswith("model.")]
        and any(k.startswith("model.") for k in want["tensors"]),
        "optimizer": not [k for k in differing if not k.startswith("model.")]
        and any(k.startswith("optim.") for k in want["tensors"]),
        "gguf": got["gguf"] == want["gguf"],
        "reported": not reported,
        "differing": (differing + reported)[:8],
    }


def uninterrupted(job: Job, text: Path, out: Path, timeout: float = 600.0) -> dict:
    """The run that loses nothing (``--max-restarts 1``, snapshots taken): its fingerprint and seconds."""
    began = time.time()
    run = Launch(["--max-restarts", "1", *job.argv(text, out, "straight")], environment(out, "straight"))
    code = run.wait(timeout)
    if code != 0:
        raise RuntimeError(f"the uninterrupted run exited {code}:\n{run.tail()}")
    return {"fingerprint": fingerprint(out, "straight", job.steps), "wall_s": time.time() - began}


def _fault(run: Launch, case: Case, ready: Path, timeout: float) -> dict:
    """Wait for the victim in its phase, signal it; what was done and committed at that moment."""
    deadline = time.time() + timeout
    while not ready.exists():
        if run.poll_ended() or time.time() > deadline:
            raise RuntimeError(
                f"{case.name}: the victim never reached its phase (exit {run.proc.poll()}):\n{run.tail()}"
            )
        time.sleep(0.02)
    pid = int(ready.read_text().split()[0])
    born = _start_ticks(pid)
    if case.signal == "SIGKILL":
        time.sleep(0.3)  # the peers reach their wait for it
    at = time.time()
    os.kill(pid, SIGNALS[case.signal])
    return {"t": at, "pid": pid, "born": born, "done_at_signal": run.progress()}


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (tells it from a later process with its pid)."""
    with contextlib.suppress(OSError, IndexError, ValueError):
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    return None


def _running(done: int | None, comm: int | None) -> int | None:
    """The step the signal interrupted: the one after the last committed, or (its commit torn) that one."""
    if done is None:
        return None
    return done if comm is not None and comm < done else done + 1


def _end(run: Launch, hit: dict, timeout: float) -> int:
    code = run.wait(timeout)
    if hit["born"] is not None and _start_ticks(hit["pid"]) == hit["born"]:  # a stopped victim nobody killed
        with contextlib.suppress(ProcessLookupError):
            os.kill(hit["pid"], signal.SIGKILL)
    return code


def _faulted(case: Case, job: Job, text: Path, out: Path, name: str, restarts: int,
             timeout: float) -> tuple[Launch, dict, int | None, int]:
    """The job run with ``--max-restarts restarts`` and the case's fault: the launch, what the signal hit,
    the step every rank had committed at it (snapshots only: ``restarts > 0``) and the exit status."""
    ready = out / f"{name}.ready"
    run = Launch(
        ["--max-restarts", str(restarts), *job.argv(text, out, name)],
        environment(out, name, f"{case.victim},{case.phase},{case.step},{ready}"),
    )
    try:
        hit = _fault(run, case, ready, timeout)
        comm = committed(out / f"shm-{name}") if restarts else None
        code = _end(run, hit, timeout)
    finally:
        if run.proc.poll() is None:
            run.kill()
    return run, hit, comm, code


def from_snapshot(case: Case, job: Job, text: Path, out: Path, want: dict, timeout: float = 600.0) -> dict:
    """The fault recovered by torch's agent from the in-memory snapshots (module docstring)."""
    name = f"{case.name}-snap"
    run, hit, comm, code = _faulted(case, job, text, out, name, 1, timeout)
    result = {"exit": code, "done_at_signal": hit["done_at_signal"], "committed_at_signal": comm}
    if code != 0:
        return {**result, "error": run.tail()}
    summary = json.loads((out / f"{name}.json").read_text())
    times = (summary.get("restart_times") or [{}])[0]
    restored = times.get("restored_at_step")
    running = _running(hit["done_at_signal"], comm)
    t0 = hit["t"]
    detected = times.get("detected")
    result.update(
        {
            "restarts": summary.get("restarts"),
            "restored_at_step": restored,
            "lost": None if comm is None or restored is None else comm - restored,
            "recomputed": None if running is None or restored is None else running - restored,
            "seconds": _split(
                t0, detected, times.get("started"), times.get("ready"), times.get("first_step")
            ),
            "restore_call_s": times.get("restore_s"),
            "bits": compare(fingerprint(out, name, job.steps), want),
        }
    )
    return result


def from_disk(case: Case, job: Job, text: Path, out: Path, want: dict, timeout: float = 600.0) -> dict:
    """The same fault without restarts: the command fails and is run again with ``--resume`` at once."""
    name = f"{case.name}-disk"
    run, hit, _, code = _faulted(case, job, text, out, name, 0, timeout)
    failed_at = run.ended
    resumed = f"{name}-resumed"
    again = Launch(
        ["--max-restarts", "0", "--resume", str(out / f"ck-{name}"), *job.argv(text, out, resumed, name)],
        environment(out, resumed),
    )
    code2 = again.wait(timeout)
    result = {"exit": code, "resumed_exit": code2, "done_at_signal": hit["done_at_signal"]}
    if code2 != 0:
        return {**result, "error": again.tail()}
    summary = json.loads((out / f"{resumed}.json").read_text())
    times = summary.get("start_times") or {}
    restored = summary.get("first_step")
    running = _running(hit["done_at_signal"], None)
    result.update(
        {
            "restored_at_step": restored,
            "recomputed": None if running is None else running - restored,
            "seconds": _split(
                hit["t"], failed_at, times.get("started"), times.get("ready"), times.get("first_step")
            ),
            "bits": compare(fingerprint(out, resumed, job.steps, name), want, restored),
        }
    )
    return result


def _split(
    signal_at: float,
    detected: float | None,
    started: float | None,
    ready: float | None,
    first_step: float | None,
) -> dict:
    """Seconds: detection (signal -> detected), restart (-> the new workers started), restore (-> ready),
    first_step (-> the first step completed), total (signal -> first step)."""

    def gap(a, b):
        return None if a is None or b is None else round(b - a, 3)

    return {
        "detection": gap(signal_at, detected),
        "restart": gap(detected, started),
        "restore": gap(started, ready),
        "first_step": gap(ready, first_step),
        "total": gap(signal_at, first_step),
    }


def clean(out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
