"""``torch.compile(optimizer.step)`` (torch's compiled-optimizer recipe) on perparam-sharded parameters:
perparam's step hooks run eagerly (``runtime/untraced.py``), so a compiled AdamW step over ``Shard(0)``
parameters trains as the eager step; a compiled step over ``update="owner"`` parameters is refused with the
fix named. Compilation is slow on 2 cores: one tiny model, the ``eager`` backend."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import perparam
from perparam import ParamPolicy
from perparam.runtime.optim import stages
from tests.distributed import run_distributed
from tests.models import full_params


def _train(rank: int, world_size: int, compiled: bool, kind: str) -> dict:
    """Linear(8, 6), Linear(6, 3) sharded per layer and at the root, 3 steps; ``kind``: "adamw" (AdamW on
    every parameter), "owner" (the weights ``update="owner"`` under Muon, the biases AdamW), "owner_adamw"
    (the same owner weights, AdamW on every parameter). Returns the parameters."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 3))
    policy = {"weight": ParamPolicy(update="owner")} if kind.startswith("owner") else None
    for layer in model:
        perparam.fully_shard(layer, param_policy=policy)
    perparam.fully_shard(model)
    if kind == "owner":
        weights = [layer.weight for layer in model]
        opts = [torch.optim.Muon(weights, lr=0.02),
                torch.optim.AdamW([layer.bias for layer in model], lr=0.01)]
    elif kind == "owner_adamw":  # the owner weights routed to their owners, stepped there whole by AdamW
        opts = [torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)]
    else:
        opts = [torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)]

    def step() -> None:
        for opt in opts:
            opt.step()

    run = torch.compile(step, backend="eager") if compiled else step
    traced = []  # whether Dynamo was tracing perparam's step pre-hook (its first stage, run on every step)
    original = stages.CountStep.before
    stages.CountStep.before = lambda *a: (traced.append(torch.compiler.is_compiling()), original(*a))[1]
    g = torch.Generator().manual_seed(1)
    try:
        for _ in range(3):
            x = torch.randn(4 * world_size, 8, generator=g)[4 * rank:4 * rank + 4]
            F.mse_loss(model(x), torch.ones(4, 3)).backward()
            run()
            for opt in opts:
                opt.zero_grad()
    finally:
        stages.CountStep.before = original
    assert len(traced) == 3 * len(opts) and not any(traced), traced  # eager, once per step per optimizer
    return full_params(model)


def _both(rank: int, world_size: int, kind: str) -> tuple[dict, dict]:
    return _train(rank, world_size, False, kind), _train(rank, world_size, True, kind)


def test_a_compiled_adamw_step_on_sharded_parameters_trains_as_the_eager_step():
    for eager, compiled in run_distributed(_both, 2, "adamw", timeout=300):
        for name, want in eager.items():
            torch.testing.assert_close(compiled[name], want, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("kind", ["owner", "owner_adamw"])
def test_a_compiled_step_over_owner_parameters_trains_as_the_eager_step(kind):
    for eager, compiled in run_distributed(_both, 2, kind, timeout=300):
        for name, want in eager.items():
            torch.testing.assert_close(compiled[name], want, atol=1e-6, rtol=0, msg=name)
