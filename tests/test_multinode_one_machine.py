"""The README's multi-node command, proven on one machine: two ``torchrun`` launchers (``--nnodes 2``,
c10d rendezvous at 127.0.0.1), ``--config tiny``, HSDP with ``--dp-replicate 2`` so the replicate axis
crosses the two "nodes". The losses equal those of one ``perparam finetune`` launcher with the same ranks."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import uuid

import pytest

from tests.test_finetune_cli import REPO, SONNET, _cli, _env

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
                              cwd=REPO, env={**_env(), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"},
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
    proc = _cli(*flags, "--nproc", str(world), "--summary-json", str(single))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ref = json.loads(single.read_text())
    for key in ("train_losses", "heldout_loss_before", "heldout_loss_after"):
        assert summary[key] == pytest.approx(ref[key], abs=1e-6), key
