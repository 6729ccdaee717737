"""``perparam finetune`` stopped from outside: Ctrl-C, SIGTERM, SIGKILL of the launcher, SIGKILL of a worker.

Each run is a real launcher with 2 tiny workers. Every test asserts the exit status, that stderr holds no
traceback, and that no worker process and no temporary folder of the run is left. The waits are guards
against a hang, generous for a loaded 2-core machine (5 runs at once), never timing claims: each test
acts on what a run printed (a step, a checkpoint), not after a sleep.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from perparam.finetune import lifecycle
from tests.conftest import SONNET
from tests.finetune_helpers import count_tracebacks, subprocess_env

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _workers_of(launcher_pid: int) -> list[int]:
    """Live workers started by this launcher: their argv names its ``perparam-finetune-<pid>-`` folder."""
    marker = f"{lifecycle.TMP_PREFIX}{launcher_pid}-".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and b"--prepared" in cmd and state != "Z":
            found.append(int(entry.name))
    return found


class Run:
    def __init__(self, tmp_path: Path, steps: int = 2000, flags: tuple[str, ...] = ()) -> None:
        text = tmp_path / "text"
        text.mkdir()
        (text / "a.txt").write_text(SONNET * 60)
        (text / "b.txt").write_text(SONNET[::-1] * 20)
        self.tmp = tmp_path / "tmp"  # TMPDIR of the launcher: its temporary folders land here
        self.tmp.mkdir()
        self.out, self.err = tmp_path / "out.txt", tmp_path / "err.txt"
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "perparam.cli", "finetune", "--config", "tiny", "--text", str(text),
                 "--nproc", "2", "--steps", str(steps), "--seq-len", "32", "--batch-size", "2",
                 "--eval-tokens", "64", *flags],
                stdout=out, stderr=err, cwd=REPO, env={**subprocess_env(), "TMPDIR": str(self.tmp)},
                start_new_session=True)

    def wait_for_step(self, step: int = 2, timeout: float = 300, text: str | None = None) -> None:
        deadline = time.monotonic() + timeout
        while (text or f"step {step}/") not in self.out.read_text():
            assert self.proc.poll() is None, self.out.read_text() + self.err.read_text()
            assert time.monotonic() < deadline, "no training step within the timeout"
            time.sleep(0.1)

    def finish(self, timeout: float = 120) -> tuple[int, str]:
        code = self.proc.wait(timeout=timeout)
        return code, self.err.read_text()

    def files(self) -> list[Path]:  # torch's compile cache is shared by every run, not a file of this one
        return [p for p in self.tmp.iterdir() if not p.name.startswith("torchinductor_")]

    def assert_nothing_left(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while (left := _workers_of(self.proc.pid)) or self.files():
            if time.monotonic() > deadline:
                for pid in left:
                    os.kill(pid, signal.SIGKILL)
                raise AssertionError(f"left after {timeout} s: workers {left}, files {self.files()}")
            time.sleep(0.2)





@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupted_run_says_one_line_and_stops_its_workers(tmp_path, sig, code):
    run = Run(tmp_path)
    run.wait_for_step(2)
    run.proc.send_signal(sig)
    status, err = run.finish()
    assert status == code, err
    assert count_tracebacks(err) == 0, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("perparam finetune: interrupted at step "), err
    assert lines[0].endswith("/2000; nothing saved"), err
    run.assert_nothing_left()


def test_an_interrupted_run_names_its_last_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    run = Run(tmp_path, flags=("--save", str(ckpt), "--save-every", "2"))
    run.wait_for_step(text="checkpoint: step 2 in")
    run.proc.send_signal(signal.SIGINT)
    status, err = run.finish()
    assert status == 130 and count_tracebacks(err) == 0, err
    match = re.fullmatch(r"perparam finetune: interrupted at step (\d+)/2000; last checkpoint: step (\d+) in "
                         r"(.+)",
                         err.strip())
    assert match, err
    step, saved, folder = int(match[1]), int(match[2]), Path(match[3])
    assert folder == ckpt.absolute() and saved % 2 == 0 and 2 <= saved <= step, err
    assert (folder / f"step-{saved:06d}").is_dir()
    run.assert_nothing_left()


def test_a_killed_launcher_takes_its_workers_and_files_with_it(tmp_path):
    run = Run(tmp_path)
    run.wait_for_step(2)
    assert len(_workers_of(run.proc.pid)) == 2
    run.proc.kill()
    status, err = run.finish()
    assert status == -signal.SIGKILL
    run.assert_nothing_left()
    assert count_tracebacks(err) == 0, err


def test_a_killed_worker_stops_the_run(tmp_path):
    run = Run(tmp_path)
    run.wait_for_step(2)
    workers = _workers_of(run.proc.pid)
    assert len(workers) == 2
    os.kill(workers[-1], signal.SIGKILL)
    status, err = run.finish()
    assert status == 1, err
    assert count_tracebacks(err) == 0, err
    assert "was killed by signal 9" in err.strip().splitlines()[-1], err
    run.assert_nothing_left()


def test_a_killed_worker_after_a_checkpoint_names_it(tmp_path):
    ckpt = tmp_path / "ckpt"
    run = Run(tmp_path, flags=("--save", str(ckpt), "--save-every", "2"))
    run.wait_for_step(text="checkpoint: step 2 in")
    os.kill(_workers_of(run.proc.pid)[-1], signal.SIGKILL)
    status, err = run.finish()
    assert status == 1 and count_tracebacks(err) == 0, err
    assert re.fullmatch(r"perparam finetune: error: rank \d was killed by signal 9 \(its output is above\); "
                        r"the other "
                        r"ranks were stopped; last checkpoint: step \d+ in "
                        rf"{re.escape(str(ckpt.absolute()))}",
                        err.strip().splitlines()[-1]), err
    run.assert_nothing_left()


def test_a_stopped_worker_is_named_and_killed_by_the_step_watchdog(tmp_path):
    ckpt = tmp_path / "ckpt"
    run = Run(tmp_path, flags=("--save", str(ckpt), "--save-every", "2", "--step-timeout", "3"))
    run.wait_for_step(text="checkpoint: step 2 in")
    workers = _workers_of(run.proc.pid)
    os.kill(workers[-1], signal.SIGSTOP)  # without the watchdog: a hang until --pg-timeout (300 s)
    status, err = run.finish()
    assert status == 1 and count_tracebacks(err) == 0, err
    lines = err.strip().splitlines()
    assert len(lines) == 2, err
    said = re.fullmatch(rf"perparam: rank (\d) \(host \S+, pid {workers[-1]}\) was stopped: rank \d saw no "
                        r"step for "
                        r"[\d.]+ s, over the step watchdog's bound of 3.0 s \(set\); killed it", lines[0])
    assert said, err
    assert re.fullmatch(rf"perparam finetune: error: rank {said[1]} was killed by signal 9 \(its output is "
                        r"above\); "
                        r"the other ranks were stopped; last checkpoint: step \d+ in .+", lines[1]), err
    run.assert_nothing_left()


def test_a_stale_temporary_folder_is_removed_at_the_next_start(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = tmp_path / f"{lifecycle.TMP_PREFIX}{gone.pid}-abc"
    stale.mkdir()
    (stale / "data.pt").write_bytes(b"x" * 1000)
    alive = tmp_path / f"{lifecycle.TMP_PREFIX}{os.getpid()}-abc"  # this process: not stale
    alive.mkdir()
    other = tmp_path / f"{lifecycle.TMP_PREFIX}notapid"
    other.mkdir()
    assert lifecycle.clean_stale_tmpdirs(str(tmp_path)) == [stale]
    assert not stale.exists() and alive.exists() and other.exists()


def test_a_signal_hidden_behind_another_error_still_reads_as_the_signal():
    """torch elastic's metrics wrapper can turn a SignalException into an UnboundLocalError (the signal
    landed before its timer was set): the launcher finds the signal in the exception's context chain."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from perparam.finetune.cli import _signal_in_chain

    try:
        try:
            raise SignalException("Process got signal: 2", sigval=signal.SIGINT)
        finally:
            raise UnboundLocalError("cannot access local variable 'start'")
    except UnboundLocalError as exc:
        found = _signal_in_chain(exc, (SignalException,))
    assert found is not None and found.sigval == signal.SIGINT
    assert _signal_in_chain(ValueError("x"), (SignalException,)) is None
