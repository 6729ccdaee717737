"""A user's training script, one rank of it, for the fault harness (``benchmarks/harness/faults.py``): a
plain ``fully_shard`` loop started with ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` (rank 0 hosts
the store, as ``init_process_group("gloo")`` does without torchrun), gloo's default 30-minute timeout, no
``try``: what the user sees is what Python prints.

``python -m benchmarks.harness.fault_worker PHASE VICTIM STEP CKPT [WATCHDOG]``: at step ``STEP`` the rank
``VICTIM`` prints ``in-PHASE <pid>`` on stdout once it is inside ``PHASE`` (``start``: before the step's
forward, ``forward``, ``backward``, ``step``: the
optimizer step, ``save``: ``perparam.checkpoint.save`` writing its files, ``async_save``: the background
write, waited for) and stays there, so the harness can SIGKILL or SIGSTOP it in that phase. Every rank saves
a checkpoint at step 1 (the last complete one), and prints ``step N`` after each step. ``WATCHDOG``: run
the loop under ``perparam.elastic.StepWatchdog`` with that bound in seconds (``0``: the derived default).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import perparam
import perparam.checkpoint


def _stay(phase: str) -> None:
    print(f"in-{phase} {os.getpid()}", flush=True)
    time.sleep(60)


def main() -> None:
    phase, victim, at, ckpt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    watchdog_s = float(sys.argv[5]) if len(sys.argv) > 5 else None
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    for layer in (model[0], model[2], model[4]):
        perparam.fully_shard(layer)
    perparam.fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = {"n": 0}
    trap = rank == victim

    def in_forward(module, args):
        if trap and step["n"] == at and phase == "forward":
            _stay("forward")

    def in_backward(grad):
        if trap and step["n"] == at and phase == "backward":
            _stay("backward")
        return grad

    def in_step(opt, args, kwargs):
        if trap and step["n"] == at and phase == "step":
            _stay("step")

    model[2].register_forward_pre_hook(in_forward)

    def hook_backward(module, args, out):
        out.register_hook(in_backward)

    model[1].register_forward_hook(hook_backward)
    optimizer.register_step_pre_hook(in_step)
    if trap and phase in ("save", "async_save"):
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        write_data = FileSystemWriter.write_data

        def slow_write(self, plan, planner):
            if step["n"] == at:
                _stay(phase)
            return write_data(self, plan, planner)

        FileSystemWriter.write_data = slow_write
    watchdog = None
    if watchdog_s is not None:
        from perparam.elastic import StepWatchdog

        watchdog = StepWatchdog(timeout=watchdog_s or None)
    for n in range(at + 3):
        step["n"] = n
        if trap and n == at and phase == "start":  # before this step's forward: the peers wait for it
            _stay("start")
        x = torch.randn(8, 16)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if n == 1 or (n == at and phase == "save"):
            perparam.checkpoint.save(f"{ckpt}/step-{n}", model, optimizer)
        if n == at and phase == "async_save":
            perparam.checkpoint.async_save(f"{ckpt}/step-{n}", model, optimizer).wait()
        if watchdog is not None:
            watchdog.step()
        print(f"step {n}", flush=True)
    if watchdog is not None:
        watchdog.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
