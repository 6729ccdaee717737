"""Parity: a model sharded with ``placement="auto"`` (Shard(1) and Replicate chosen) trains like one
process."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import perparam
from perparam import ParamPolicy
from tests.distributed import run_distributed

STEPS, BATCH, TOL = 4, 8, 1e-5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(80, 5), nn.Tanh(), nn.Linear(5, 2))  # (5, 80): Shard(1) at K = 2


def _data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 80, generator=g), torch.randn(BATCH, 2, generator=g)) for _ in range(STEPS)]


def _train(model, rank: int = 0, world: int = 1):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    n = BATCH // world
    for x, y in _data():
        F.mse_loss(model(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n]).backward()
        opt.step()
        opt.zero_grad()


def sharded(rank: int, world: int):
    model = _model()
    perparam.fully_shard(model, param_policy=ParamPolicy(placement="auto"))
    placements = {n: p.placements for n, p in model.named_parameters()}
    _train(model, rank, world)
    return placements, {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def test_auto_placed_model_trains_like_one_process():
    ref = _model()
    _train(ref)
    for placements, params in run_distributed(sharded, 2):
        assert placements["0.weight"] == (Shard(1),) and placements["0.bias"] == (Replicate(),)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(params[name], p.detach(), atol=TOL, rtol=TOL)
