"""``perparam finetune`` when a node's memory is lost: two ``torchrun`` nodes of 2 ranks each on this machine,
one node's agent and workers SIGKILLed from outside: the other node's agent restarts its workers, which
continue with K = 2 from their own snapshots and the replicas of the lost node's (each node's snapshots in
its own folder, the lost one's removed as its memory would be), and the run ends on the uninterrupted run's
GGUF and losses bit for bit (``--invariant-units``). When a shard and its replica are both lost, the job
falls back to its ``--save`` checkpoint in one line, or stops in one line when there is none."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.finetune_helpers import REPO, TINY, subprocess_env

pytestmark = pytest.mark.slow  # each case: two or three multi-process jobs, 60-150 s on a loaded 2-core host

RUN = ("--invariant-units", "8", "--batch-size", "8", "--steps", "12", "--max-grad-norm", "0.5",
       "--eval-every", "4")
SAME = ("train_losses", "grad_norms", "lrs", "heldout_loss_after", "gguf_sha256")


def _finetune(out: Path, text: Path, name: str, *flags: str, env: dict | None = None) -> subprocess.Popen:
    argv = [*TINY, "--text", str(text), *RUN, "--summary-json", str(out / f"{name}.json"),
            "--export", str(out / f"{name}.gguf"), *flags]
    return subprocess.Popen([sys.executable, "-m", "perparam.cli", "finetune", *argv], cwd=REPO,
                            env={**subprocess_env(), **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _summary(out: Path, name: str) -> dict:
    summary = json.loads((out / f"{name}.json").read_text())
    summary["gguf_sha256"] = hashlib.sha256((out / f"{name}.gguf").read_bytes()).hexdigest()
    return summary


@pytest.fixture(scope="module")
def straight(tmp_path_factory, text_dir) -> dict:
    """The uninterrupted run on 2 ranks (``--invariant-units``: the bits of every K), saving every 4 steps."""
    out = tmp_path_factory.mktemp("straight")
    proc = _finetune(out, text_dir, "straight", "--nproc", "2", "--save", str(out / "ck"),
                     "--save-every", "4")
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log[-4000:]
    return _summary(out, "straight")


def _children(pid: int) -> list[int]:
    found = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            if int(Path(stat).read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(Path(stat).parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


class Lines:
    """A process's output lines, each with the time it was read."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.items: list[tuple[float, str]] = []
        threading.Thread(target=self._read, args=(proc.stdout,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in iter(stream.readline, ""):
            self.items.append((time.time(), line))

    def first(self, text: str, after: float = 0.0) -> float | None:
        return next((t for t, line in self.items if text in line and t > after), None)

    def text(self) -> str:
        return "".join(line for _, line in self.items)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _progress(path: Path) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return -1


def test_a_lost_node_costs_seconds_and_the_run_ends_on_the_uninterrupted_bits(tmp_path, text_dir, straight):
    pytest.importorskip("gguf")
    port, progress, shm = _free_port(), tmp_path / "progress", tmp_path / "shm"
    # one snapshot root for both nodes, as /dev/shm is on one machine: each agent's namespace keeps them
    # apart; torch's shared rendezvous store off (a node joining a later round waits for keys no one writes)
    env = {"PERPARAM_SNAPSHOT_DIR": str(shm), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    nodes, logs = [], []
    for name in ("a", "b"):  # node a hosts the rendezvous store (is_host), which dies with it: node b is lost
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
               "--rdzv-conf", f"is_host={name == 'a'},last_call_timeout=3,keep_alive_interval=1,"
               "keep_alive_max_attempt=3",
               "--max-restarts", "1", "--monitor-interval", "0.1", "-m", "perparam.finetune", *TINY, "--text",
               str(text_dir), *RUN, "--summary-json", str(tmp_path / "nodes.json"),
               "--export", str(tmp_path / "nodes.gguf")]
        node_env = {**subprocess_env(), **env}
        if name == "a":
            node_env["PERPARAM_PROGRESS_FILE"] = str(progress)
        nodes.append(subprocess.Popen(cmd, cwd=REPO, env=node_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
        logs.append(Lines(nodes[-1]))
    a, b = nodes
    try:
        deadline = time.time() + 240
        while _progress(progress) < 5:  # node b's workers run ranks 2 and 3 until step 5 of 12 is done
            assert a.poll() is None and b.poll() is None, logs[0].text()[-3000:] + logs[1].text()[-3000:]
            assert time.time() < deadline, "the two nodes never reached step 5"
            time.sleep(0.01)
        workers = _children(b.pid)
        assert len(workers) == 2, workers
        for pid in [*workers, b.pid]:  # the whole node: its workers and its agent
            os.kill(pid, signal.SIGKILL)
        killed = time.time()
        killed_after = _progress(progress)
        lost = [p for p in shm.glob("*/*") if p.name.endswith(f"-agent{b.pid}")]
        assert len(lost) == 1 and any(lost[0].iterdir())  # its snapshots lived in a folder of its own
        shutil.rmtree(lost[0])  # what node b held in memory is gone, as it would be with the machine
        first_step = None
        while a.poll() is None:
            restarted = logs[0].first("restart 1: continuing")
            if first_step is None and restarted is not None and progress.stat().st_mtime > restarted:
                first_step = progress.stat().st_mtime
            time.sleep(0.01)
        assert a.wait(timeout=300) == 0, logs[0].text()[-4000:]
    finally:
        for proc in nodes:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    got, log = _summary(tmp_path, "nodes"), logs[0].text()
    assert got["world_size"] == 2 and got["restarts"] == 1  # K = 2: the survivors alone
    restored = got["restored_at_step"][-1]  # (a node b that joined late: a restart 0 came first)
    # a replica's header is written at the holder's next commit: the lost node's newest may be 1 or 2 back
    assert killed_after - 2 <= restored <= killed_after
    for key in SAME:
        assert got[key] == straight[key], key
    assert "sharded over 4 ranks" in log and "sharded over 2 ranks" in log
    assert f"restart 1: continuing from the in-memory snapshot of step {restored}" in log
    assert first_step is not None
    seen = {what: logs[0].first(text, killed) - killed for what, text in (
        ("a survivor's line", "stopped: a peer process died"),  # its collective failed
        ("the model rebuilt on K = 2", "sharded over 2 ranks"), ("restored", "restart 1: continuing"))}
    print(f"\nnode b killed after step {killed_after}, restored step {restored}; seconds from the kill: "
          + ", ".join(f"{what} {s:.1f}" for what, s in seen.items())
          + f", first step {first_step - killed:.1f}")


def _launcher_progress(launcher: subprocess.Popen) -> tuple[int, int | None]:
    """``(steps done, step of the last complete checkpoint or None)`` from the launcher's progress file."""
    folders = os.path.join(tempfile.gettempdir(), f"perparam-finetune-{launcher.pid}-*")
    for path in glob.glob(os.path.join(folders, "progress")):
        try:
            lines = Path(path).read_text().splitlines()
            return int(lines[0].split()[0]), int(lines[1].split()[0]) if len(lines) > 1 else None
        except (OSError, ValueError, IndexError):
            pass
    return -1, None


def _kill_rank_and_its_memory(launcher: subprocess.Popen, rank: int, shm: Path, step: int,
                              saved: bool) -> int:
    """Once ``step`` steps are done (and, with ``saved``, a checkpoint is complete): SIGKILL ``rank``'s
    worker and delete its snapshot slots (its only copies: no replica on one node), as if its node's memory
    went with it. Returns the steps done at the kill."""
    deadline = time.time() + 240
    while time.time() < deadline:
        assert launcher.poll() is None, launcher.communicate()[0][-4000:]
        done, checkpoint = _launcher_progress(launcher)
        if done >= step and (checkpoint is not None or not saved):
            for pid in _children(launcher.pid):
                if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    os.kill(pid, signal.SIGKILL)
                    slots = glob.glob(str(shm / "*" / "*" / f"r{rank}-*"))
                    assert slots
                    for slot in slots:
                        os.unlink(slot)
                    return done
        time.sleep(0.01)
    raise AssertionError("the run never reached the step")


def test_a_shard_lost_with_its_only_copy_falls_back_to_the_last_disk_checkpoint(tmp_path, text_dir, straight):
    pytest.importorskip("gguf")
    shm, ck = tmp_path / "shm", tmp_path / "ck"
    proc = _finetune(tmp_path, text_dir, "fallback", "--nproc", "2", "--max-restarts", "1", "--save", str(ck),
                     "--save-every", "4", env={"PERPARAM_SNAPSHOT_DIR": str(shm)})
    _kill_rank_and_its_memory(proc, 1, shm, 6, saved=True)
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log[-4000:]
    got = _summary(tmp_path, "fallback")
    step, folder = got["restored_from_checkpoint"]
    assert step in (4, 8) and folder == str(ck) and got["restarts"] == 1 and got["restored_at_step"] == []
    said = [line for line in log.splitlines() if "continuing from the disk checkpoint" in line]
    assert len(said) == 1, log[-4000:]
    assert said[0].startswith("restart 1: no complete in-memory snapshot: rank(s) [1] of the newest (step ")
    assert said[0].endswith(f"; continuing from the disk checkpoint of step {step} in {ck}")
    assert got["gguf_sha256"] == straight["gguf_sha256"]
    assert got["train_losses"] == straight["train_losses"][step:]  # the steps after the checkpoint
    assert got["heldout_loss_after"] == straight["heldout_loss_after"]


def test_a_shard_lost_with_its_only_copy_and_no_disk_checkpoint_stops_in_one_line(tmp_path, text_dir):
    shm = tmp_path / "shm"
    proc = _finetune(tmp_path, text_dir, "stop", "--nproc", "2", "--max-restarts", "2",
                     env={"PERPARAM_SNAPSHOT_DIR": str(shm)})
    _kill_rank_and_its_memory(proc, 1, shm, 5, saved=False)
    log, _ = proc.communicate(timeout=240)  # no hang: the later attempt stops at once
    assert proc.returncode == 2, log[-4000:]
    said = [line for line in log.splitlines() if "stopped" in line and "in-memory snapshot" in line]
    assert len(said) == 1, log[-4000:]
    assert said[0].startswith("perparam finetune: error: restart 1: no complete in-memory snapshot: "
                              "rank(s) [1] ")
    assert said[0].endswith("no disk checkpoint to continue from (--save DIR keeps one): stopped")
    assert "Traceback" not in log
