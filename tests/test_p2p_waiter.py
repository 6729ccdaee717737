"""The waiter threads of the zero-copy reduce-scatter (``perparam.comm.collectives._Waiter``: one per
process group, waiting on gloo's send/receive works): a process that destroys its process group and trains
a new model on a new one keeps one thread per live group, and the new model trains as one process does."""

from __future__ import annotations

import gc
import os
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import perparam
from tests.distributed import one_process, run_distributed
from tests.models import TinyNet, local_slice, make_batches


def _waiters() -> int:
    return sum(t.name == "perparam-p2p-waiter" for t in threading.enumerate())


def _train(rank: int, world_size: int) -> dict:
    """3 AdamW steps of TinyNet(d=4), blocks and root sharded; ``world_size == 0``: one process, the whole
    batch."""
    torch.manual_seed(0)
    model = TinyNet(d=4)
    if world_size:
        for block in model.blocks:
            perparam.fully_shard(block)
        perparam.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in make_batches(3, 6):
        if world_size:
            x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in model.named_parameters()}


def two_worlds(rank: int, world_size: int, store_path: str) -> tuple[list[int], dict]:
    """Train, destroy the process group, train a new model on a new process group: the waiter threads
    alive after each, and the second model's parameters."""
    _train(rank, world_size)
    counts = [_waiters()]
    gc.collect()  # the sharded model references its process groups (CONTRIBUTING: known open problems)
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))
    params = _train(rank, world_size)
    gc.collect()
    counts.append(_waiters())
    return counts, params


def test_a_new_process_group_after_destroy_keeps_one_waiter_thread_per_live_group_and_trains_as_one_process(
        tmp_path):
    want = one_process(_train)
    for rank, (counts, params) in enumerate(run_distributed(two_worlds, 2, os.path.join(tmp_path, "store"))):
        assert counts[0] >= 1 and counts[1] == counts[0], (rank, counts)
        for name, p in want.items():
            torch.testing.assert_close(params[name], p, atol=1e-5, rtol=0, msg=f"rank {rank}: {name}")


_SCRIPT = """
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
import perparam

dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
for layer in model:
    perparam.fully_shard(layer, mesh=mesh)
perparam.fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters())
for _ in range(2):
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
"""


def test_a_torchrun_script_ending_in_destroy_process_group_exits_cleanly_after_zero_copy_reductions(tmp_path):
    """A plain script (no perparam teardown, as FSDP2 users write it) that trains with the zero-copy
    reduce-scatter and calls ``destroy_process_group()`` last: both ranks exit 0. Was: every rank aborted
    at exit (SIGABRT, ``terminate called without an active exception``; 4 of 4 runs) because the waiter
    thread's frame held the last gloo send/recv works while idle."""
    import socket
    import subprocess
    import sys

    from tests.finetune_helpers import REPO, subprocess_env

    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_addr", "127.0.0.1", "--master_port", str(port), str(script)],
                          cwd=REPO, env={**subprocess_env(), "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "terminate called" not in out, out
