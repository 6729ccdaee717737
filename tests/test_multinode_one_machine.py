"""The README's multi-node command, proven on one machine: two ``torchrun`` launchers (``--nnodes 2``,
c10d rendezvous at 127.0.0.1), ``--config tiny``, HSDP with ``--dp-replicate 2`` so the replicate axis
crosses the two "nodes". The losses equal those of one ``perparam finetune`` launcher with the same ranks."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import uuid

import pytest

from tests.conftest import SONNET
from tests.finetune_helpers import REPO, run_finetune, subprocess_env

FLAGS = ("--config", "tiny", "--steps", "3", "--seq-len", "32", "--eval-tokens", "64", "--dp-replicate", "2")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("per_node", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_two_torchrun_nodes_match_one_launcher(tmp_path, per_node):
    text = tmp_path / "text"
    text.mkdir()
    (text / "a.txt").write_text(SONNET * 60)
    (text / "b.txt").write_text(SONNET[::-1] * 20)
    world = 2 * per_node
    flags = (*FLAGS, "--text", str(text), "--batch-size", str(world))
    endpoint, run_id = f"127.0.0.1:{_free_port()}", uuid.uuid4().hex
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                               "--nproc_per_node", str(per_node), "--rdzv_backend", "c10d",
                               "--rdzv_endpoint", endpoint, "--rdzv_id", run_id, "-m", "perparam.finetune",
                               *flags, "--summary-json", str(tmp_path / f"node{n}.json")],
                              cwd=REPO,
                              env={**subprocess_env(), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in range(2)]
    try:
        outs = [node.communicate(timeout=300)[0] for node in nodes]  # a hang guard for a loaded machine
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert all(node.returncode == 0 for node in nodes), "\n".join(outs)
    [summary] = [json.loads(p.read_text()) for p in tmp_path.glob("node*.json")]  # global rank 0 writes it
    assert (summary["world_size"], summary["dp_replicate"], summary["dp_shard"]) == (world, 2, per_node)

    single = tmp_path / "single.json"
    proc = run_finetune(*flags, "--nproc", str(world), "--summary-json", str(single))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ref = json.loads(single.read_text())
    for key in ("train_losses", "heldout_loss_before", "heldout_loss_after"):
        assert summary[key] == pytest.approx(ref[key], abs=1e-6), key


def _wait_for(path_text, what: str, nodes, timeout: float = 300) -> None:
    """Until ``what`` is in one of the logs (read by ``path_text()``); every node must still run."""
    import time

    deadline = time.monotonic() + timeout  # a guard against a hang, not a timing claim
    while what not in path_text():
        assert all(node.poll() is None for node in nodes), path_text()
        assert time.monotonic() < deadline, f"no {what!r} within {timeout} s:\n{path_text()}"
        time.sleep(0.2)


@pytest.mark.parametrize("killed", ["rendezvous_host", "other_node"])
def test_when_one_nodes_launcher_dies_the_other_node_ends_with_one_line(tmp_path, killed):
    """SIGKILL of one node's torchrun: its worker leaves (parent-death signal / parent watch) and says so in
    one line; the surviving node's worker says in one line that a peer died, names the rank that is gone
    and the last checkpoint, and exits 1 (not as an interruption).

    Node 0 hosts the rendezvous store (``is_host=1``), so each case is one path, every time: killing it,
    the survivor's torchrun agent loses the rendezvous and stops its worker with SIGTERM (which the worker
    must not read as a user's interruption), and its collectives fail too, whichever comes first; killing
    node 1, only the collectives fail. The process-group timeout is far away (600 s): a survivor that ends
    at all noticed the death. (torchrun's own report of its failure is torchrun's, not perparam's.)"""
    import os
    import re
    import signal
    import time

    from tests.finetune_helpers import count_tracebacks

    text = tmp_path / "text"
    text.mkdir()
    (text / "a.txt").write_text(SONNET * 60)
    (text / "b.txt").write_text(SONNET[::-1] * 20)
    ckpt = tmp_path / "ckpt"
    endpoint, run_id = f"127.0.0.1:{_free_port()}", uuid.uuid4().hex
    logs = [tmp_path / f"node{n}.txt" for n in range(2)]
    nodes, workers = [], []
    for n in range(2):
        with logs[n].open("w") as log:
            nodes.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                 "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--rdzv_id", run_id,
                 "--rdzv_conf", f"is_host={int(n == 0)},read_timeout=300", "-m", "perparam.finetune", *FLAGS,
                 "--text", str(text), "--batch-size", "2", "--steps", "5000", "--pg-timeout", "600",
                 "--save", str(ckpt), "--save-every", "2"],
                cwd=REPO, env={**subprocess_env(), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"},
                stdout=log, stderr=subprocess.STDOUT, text=True))
    both = lambda: logs[0].read_text() + logs[1].read_text()  # noqa: E731
    dead, alive = (0, 1) if killed == "rendezvous_host" else (1, 0)
    try:
        _wait_for(both, "checkpoint: step 2 in", nodes)  # rank 0, on either node, saved once
        pgrep = subprocess.run(["pgrep", "-P", str(nodes[dead].pid)], capture_output=True, text=True)
        workers = [int(pid) for pid in pgrep.stdout.split()]
        nodes[dead].kill()
        assert nodes[alive].wait(timeout=300) != 0
        out = logs[alive].read_text()
        ours = [line for line in out.splitlines() if line.startswith("perparam finetune:")]
        assert len(ours) == 1 and "a peer process died" in ours[0] and "is gone" in ours[0], out
        saved = re.search(r"; last checkpoint: step (\d+) in (.+)$", ours[0])
        assert saved and int(saved[1]) % 2 == 0 and saved[2] == str(ckpt), ours[0]
        assert (ckpt / f"step-{int(saved[1]):06d}").is_dir()
        frames = [line for line in out.splitlines() if line.lstrip().startswith("File ")]
        assert not any("perparam" in line for line in frames), out  # only torchrun's own report
        deadline = time.monotonic() + 60
        while any(os.path.exists(f"/proc/{pid}") and "Z" not in open(f"/proc/{pid}/stat").read().split()[2]
                  for pid in workers):
            assert time.monotonic() < deadline, f"the killed node's worker {workers} still runs"
            time.sleep(0.2)
        out_dead = logs[dead].read_text()
        gone = re.search(r"perparam finetune: rank (\d) stopped: its torchrun launcher is gone", out_dead)
        assert gone and count_tracebacks(out_dead) == 0, out_dead
        # named by rank when its process is seen gone, else by the store it hosted
        assert f"rank {gone[1]} (node" in ours[0] or "rendezvous store" in ours[0], ours[0]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.send_signal(signal.SIGKILL)
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
