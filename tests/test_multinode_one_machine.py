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
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node",
                               str(per_node), "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--rdzv_id",
                               run_id, "-m", "perparam.finetune", *flags,
                               "--summary-json", str(tmp_path / f"node{n}.json")],
                              cwd=REPO, env={**subprocess_env(), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in range(2)]
    try:
        outs = [node.communicate(timeout=180)[0] for node in nodes]
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


def test_when_one_nodes_launcher_dies_the_other_node_ends_with_one_line(tmp_path):
    """SIGKILL of node 1's torchrun: its worker leaves (parent-death signal / parent watch) and says so in
    one line; node 0's worker loses its peer and says so in one line, well within the process-group
    timeout. (torchrun's own report of the failed worker on node 0 is torchrun's, not perparam's.)"""
    import os
    import signal
    import time

    from tests.finetune_helpers import count_tracebacks

    text = tmp_path / "text"
    text.mkdir()
    (text / "a.txt").write_text(SONNET * 60)
    (text / "b.txt").write_text(SONNET[::-1] * 20)
    endpoint, run_id = f"127.0.0.1:{_free_port()}", uuid.uuid4().hex
    logs = [tmp_path / f"node{n}.txt" for n in range(2)]
    nodes, workers = [], []
    for n in range(2):
        with logs[n].open("w") as log:
            nodes.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                 "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--rdzv_id", run_id, "-m",
                 "perparam.finetune", *FLAGS, "--text", str(text), "--batch-size", "2", "--steps", "5000",
                 "--pg-timeout", "30"],
                cwd=REPO, env={**subprocess_env(), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"},
                stdout=log, stderr=subprocess.STDOUT, text=True))
    try:
        deadline = time.monotonic() + 120
        while "step 3/" not in logs[0].read_text():
            assert all(node.poll() is None for node in nodes), logs[0].read_text() + logs[1].read_text()
            assert time.monotonic() < deadline
            time.sleep(0.2)
        workers = [int(pid) for pid in subprocess.run(["pgrep", "-P", str(nodes[1].pid)], capture_output=True,
                                                      text=True).stdout.split()]
        start = time.monotonic()
        nodes[1].kill()
        code = nodes[0].wait(timeout=60)
        assert code != 0 and time.monotonic() - start < 30
        out0 = logs[0].read_text()
        ours = [line for line in out0.splitlines() if line.startswith("perparam finetune:")]
        assert len(ours) == 1 and "a peer process died" in ours[0], out0
        frames = [line for line in out0.splitlines() if line.lstrip().startswith("File ")]
        assert not any("perparam" in line for line in frames), out0  # only torchrun's own report
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{pid}") and "Z" not in open(f"/proc/{pid}/stat").read().split()[2]
                  for pid in workers):
            assert time.monotonic() < deadline, f"node 1's worker {workers} still runs"
            time.sleep(0.2)
        out1 = logs[1].read_text()
        assert "its torchrun launcher is gone" in out1 and count_tracebacks(out1) == 0, out1
    finally:
        for node in nodes:
            if node.poll() is None:
                node.send_signal(signal.SIGKILL)
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
