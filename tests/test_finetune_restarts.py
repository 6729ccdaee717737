"""``perparam finetune --max-restarts N``: a worker SIGKILLed from outside mid-run is restarted by torch's
elastic agent and the job continues from the in-memory snapshot of the last completed step; with
``--invariant-units`` it ends on the uninterrupted run's losses, held-out losses, gradient norms, GGUF and
final checkpoint (parameters and every AdamW state tensor) bit for bit, and the summary records the
restart."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from tests.finetune_helpers import REPO, TINY, assert_one_line_error, subprocess_env

RUN = ("--nproc", "4", "--invariant-units", "8", "--batch-size", "8", "--steps", "12", "--max-grad-norm",
       "0.5", "--eval-every", "4", "--save-every", "12")


def _launch(out: Path, text: Path, name: str, *flags: str) -> subprocess.Popen:
    argv = [*TINY, "--text", str(text), *RUN, "--summary-json", str(out / f"{name}.json"), "--export",
            str(out / f"{name}.gguf"), "--save", str(out / f"ck-{name}"), *flags]
    return subprocess.Popen([sys.executable, "-m", "perparam.cli", "finetune", *argv], cwd=REPO,
                            env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _done(out: Path, name: str, proc: subprocess.Popen) -> tuple[dict, str]:
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log[-4000:]
    summary = json.loads((out / f"{name}.json").read_text())
    summary["gguf_sha256"] = hashlib.sha256((out / f"{name}.gguf").read_bytes()).hexdigest()
    return summary, log


def _checkpoint(folder: Path, tmp: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = tmp / f"{folder.parent.name}.pt"
    dcp_to_torch_save(folder, flat)
    return torch.load(flat, weights_only=False)


def _worker(launcher: int, rank: int) -> int | None:
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            ppid = int(Path(stat).read_text().rsplit(")", 1)[1].split()[1])
            env = Path(stat).with_name("environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == launcher and f"RANK={rank}".encode() in env:
            return int(Path(stat).parent.name)
    return None


def _kill_at_step(proc: subprocess.Popen, rank: int, step: int) -> int:
    """SIGKILL the worker of ``rank`` once the launcher's progress file says ``step`` steps are done; the step
    it was killed after."""
    deadline = time.time() + 240
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        for progress in glob.glob(os.path.join(tempfile.gettempdir(), f"perparam-finetune-{proc.pid}-*",
                                               "progress")):
            try:
                done = int(Path(progress).read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            pid = _worker(proc.pid, rank)
            if done >= step and pid is not None:
                os.kill(pid, signal.SIGKILL)
                return done
        time.sleep(0.01)
    raise AssertionError("the run never reached the step")


@pytest.mark.slow
def test_a_rank_killed_at_step_5_of_12_ends_on_the_uninterrupted_runs_bits(tmp_path, text_dir):
    pytest.importorskip("gguf")
    straight = _launch(tmp_path, text_dir, "straight")
    want, _ = _done(tmp_path, "straight", straight)
    faulted = _launch(tmp_path, text_dir, "killed", "--max-restarts", "2")
    killed_after = _kill_at_step(faulted, rank=1, step=5)
    got, log = _done(tmp_path, "killed", faulted)
    assert 5 <= killed_after < 12
    assert got["restarts"] == 1 and len(got["restored_at_step"]) == 1
    # the progress file says a step is done before its snapshot is committed: the kill may land between the
    # two
    assert got["restored_at_step"][0] >= killed_after - 1
    times = got["restart_times"][0]  # the restart's timeline, in order (seconds: benchmarks/fault_matrix.py)
    assert times["restart"] == 1 and times["restored_at_step"] == got["restored_at_step"][0]
    assert times["detected"] <= times["started"] <= times["ready"] <= times["first_step"]
    for key in ("train_losses", "grad_norms", "heldout_losses", "lrs", "heldout_loss_before",
                "heldout_loss_after", "gguf_sha256"):
        assert got[key] == want[key], key
    a = _checkpoint(tmp_path / "ck-straight" / "step-000012", tmp_path)
    b = _checkpoint(tmp_path / "ck-killed" / "step-000012", tmp_path)
    assert a.keys() == b.keys() and any(k.startswith("optim.") for k in a)
    for key, value in a.items():
        if torch.is_tensor(value):
            assert torch.equal(value.view(-1).view(torch.uint8), b[key].view(-1).view(torch.uint8)), key
    assert f"continuing from the in-memory snapshot of step {got['restored_at_step'][0]}" in log


@pytest.mark.parametrize("flags,expect", [
    (["--max-restarts", "-1"], "--max-restarts -1 must be 0 or more"),
    (["--max-restarts", "1", "--snapshot-every", "0"], "--snapshot-every 0 must be 1 or more"),
    (["--max-restarts", "1", "--nproc", "2", "--tp", "2"],
     "--max-restarts with --tp 2: in-memory snapshots do not"),
])
def test_max_restarts_refuses_what_cannot_compose_in_one_line(capsys, text_dir, flags, expect):
    assert_one_line_error(capsys, [*TINY, "--text", str(text_dir), *flags], expect)
