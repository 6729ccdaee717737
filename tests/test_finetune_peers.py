"""A worker stopped by ``torchrun``'s agent with SIGTERM tells a lost peer node from a user's interruption
(``perparam.finetune.peers``): one line naming who is gone and the last checkpoint, exit 1; or, with every
store answering and every peer running, the interruption line and 143."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from perparam.finetune import peers
from tests.finetune_helpers import REPO, subprocess_env

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
              pytest.mark.fast]

#: a torchrun worker (no perparam launcher) that has finished step 5 of 10 and saved step 4
WORKER = textwrap.dedent("""
    import os, socket, sys, time
    from perparam.finetune import lifecycle, peers
    lifecycle.install_worker_handlers()
    dead_peer = int(sys.argv[1])
    if dead_peer:  # rank 0 on node 0 (this host) was this process's peer
        peers.ROSTER[:] = [{"host": socket.gethostname(), "pid": dead_peer, "node": 0},
                           {"host": socket.gethostname(), "pid": os.getpid(), "node": 1}]
    lifecycle.step_done(5, 10)
    lifecycle.checkpoint_done(4, "/ckpt")
    print("ready", flush=True)
    time.sleep(120)
""")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: connections are refused


def _sigterm_worker(store_port: int, dead_peer: int = 0, rank: int = 0) -> tuple[int, str]:
    env = {**subprocess_env(), "RANK": str(rank), "LOCAL_RANK": "0", "GROUP_RANK": str(rank),
           "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "test", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(store_port)}
    env.pop("PET_RDZV_ENDPOINT", None)
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(dead_peer)], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


def test_a_sigterm_after_the_store_host_died_names_it_and_exits_1():
    port = _closed_port()
    code, err = _sigterm_worker(port, rank=1)
    assert code == 1, err
    assert err.strip() == ("perparam finetune: rank 1 stopped: a peer process died (node 0 (host of the "
                           f"workers' store 127.0.0.1:{port}) is gone); last checkpoint: step 4 in "
                           "/ckpt"), err


def test_a_sigterm_after_a_peer_nodes_rank_died_names_the_rank():
    gone = subprocess.Popen(["true"])
    gone.wait()
    with socket.socket() as store:  # the workers' store still answers
        store.bind(("127.0.0.1", 0))
        store.listen()
        code, err = _sigterm_worker(store.getsockname()[1], dead_peer=gone.pid, rank=1)
    assert code == 1, err
    assert err.strip() == ("perparam finetune: rank 1 stopped: a peer process died (rank 0 (node 0) is "
                           "gone); last checkpoint: step 4 in /ckpt"), err


def test_a_sigterm_with_every_peer_and_store_alive_is_an_interruption():
    with socket.socket() as store:
        store.bind(("127.0.0.1", 0))
        store.listen()
        code, err = _sigterm_worker(store.getsockname()[1], dead_peer=os.getpid())  # this test runs: alive
    assert code == 143, err
    assert err.strip() == "perparam finetune: interrupted at step 5/10; last checkpoint: step 4 in /ckpt", err


def test_the_rendezvous_endpoint_is_read_from_torchruns_command_line():
    argv = ["python", "-m", "torch.distributed.run", "--nnodes", "2", "--rdzv_endpoint", "10.0.0.7:29500",
            "x"]
    assert peers.rendezvous_endpoint(argv) == ("10.0.0.7", 29500)
    assert peers.rendezvous_endpoint(["torchrun", "--rdzv-endpoint=node7", "x"]) == ("node7", 29400)
    assert peers.rendezvous_endpoint(["torchrun", "--rdzv-endpoint", "[::1]:1234"]) == ("::1", 1234)
    assert peers.rendezvous_endpoint(["torchrun", "--standalone", "x"]) is None


def test_the_lost_peer_line_says_what_is_known():
    line = peers.lost_peer_line(3, None, "Timed out", None)
    assert line == ("perparam finetune: rank 3 stopped: a peer process died or hung (no peer is known to be "
                    "gone; during a collective: Timed out); nothing saved")
