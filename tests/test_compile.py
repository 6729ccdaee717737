"""``torch.compile`` of a sharded model (whole or per block, compiled before or after ``fully_shard``) trains
as the same sharded model run eagerly: equal losses, gradients and collectives.

Compiling traced perparam's hooks, and the graph's replay of the unsharded buffer's storage resize bumped
the version counter of the parameters autograd saved: the first backward failed
(``perparam/runtime/untraced.py``). Compilation is slow on 2 cores: few, tiny cases.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import perparam
from perparam import CommCounter
from tests.distributed import run_distributed
from tests.models import TinyNet, local_slice, make_batches

STEPS = 2


def _build(world_size: int, backend: str | None, where: str):
    """TinyNet(d=4) with its blocks and root sharded (blocks reshard after forward), compiled by ``backend``
    (``None``: eager) per block before or after ``fully_shard``, or whole after it."""
    torch.manual_seed(0)
    model = TinyNet(d=4, n_blocks=2)
    if backend and where == "blocks_before":
        for block in model.blocks:
            block.compile(backend=backend)
    for block in model.blocks:
        perparam.fully_shard(block, reshard_after_forward=True)
    perparam.fully_shard(model)
    if backend and where == "blocks_after":
        for block in model.blocks:
            block.compile(backend=backend)
    run = torch.compile(model, backend=backend) if backend and where == "whole_after" else model
    return model, run


def _train(model, run, rank: int, world_size: int) -> tuple[list[float], dict, list[dict]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, comms = [], []
    for x, y in make_batches(STEPS, 4):
        with CommCounter() as comm:
            loss = F.mse_loss(run(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
            loss.backward()
        comms.append(comm.by_kind())
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in model.named_parameters()}
    return losses, {**{f"grad.{n}": g for n, g in grads.items()}, **params}, comms


WHERE = ("blocks_after", "whole_after", "blocks_before")


def compiled_and_eager(rank: int, world_size: int, backend: str) -> tuple:
    eager = _train(*_build(world_size, None, ""), rank, world_size)
    return eager, [_train(*_build(world_size, backend, where), rank, world_size) for where in WHERE]


def test_aot_eager_compiled_model_whole_or_per_block_before_or_after_sharding_trains_as_eager():
    for eager, compiled in run_distributed(compiled_and_eager, 2, "aot_eager", timeout=300):
        for where, (losses, tensors, comms) in zip(WHERE, compiled):
            assert losses == pytest.approx(eager[0], abs=1e-6), where
            for name, t in eager[1].items():
                torch.testing.assert_close(tensors[name], t, atol=1e-6, rtol=0, msg=f"{where}: {name}")
            assert comms == eager[2], where
