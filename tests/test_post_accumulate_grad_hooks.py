"""``p.register_post_accumulate_grad_hook(fn)`` on a sharded parameter fires once per reduced gradient,
after the sharded ``.grad`` is in place, on every rank (a rank with an empty shard too), never for
micro-batches accumulated without sync nor for a parameter no rank used; a hook registered before
``fully_shard`` carries over; an optimizer stepped inside the hooks (optimizer in backward) matches one
process. A ``register_hook`` hook on a parameter, which could never fire once it is replaced, is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import perparam
from tests.distributed import run_distributed
from tests.models import TinyNet, local_slice, make_batches


class TwoHeads(nn.Module):
    """``Linear(4, 2)`` (empty shards on 3 ranks) and a head no rank uses."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 2)
        self.unused = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def fired(rank: int, world_size: int, before: bool) -> dict:
    torch.manual_seed(0)
    model = TwoHeads()
    calls: list = []

    def record(p: torch.Tensor) -> None:
        calls.append((names[id(p)], isinstance(p.grad, DTensor), tuple(p.grad.to_local().shape)))

    if before:
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(record)
    perparam.fully_shard(model.used)
    perparam.fully_shard(model)
    names = {id(p): n for n, p in model.named_parameters()}
    if not before:
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(record)
    x = torch.randn(2, 4)
    per_backward = []
    for sync in (False, False, True, True):  # two micro-batches without sync, then two synchronising steps
        model.set_requires_gradient_sync(sync)
        model(x).sum().backward()
        per_backward.append(sorted(calls))
        calls.clear()
    return {"per_backward": per_backward, "local_rows": model.used.weight.to_local().shape[0]}


@pytest.mark.parametrize("before", [False, True], ids=["registered_after", "registered_before_fully_shard"])
def test_hooks_fire_once_per_reduced_gradient_on_every_rank_including_an_empty_shard(before):
    results = run_distributed(fired, 3, before)
    assert [r["local_rows"] for r in results] == [1, 1, 0]  # rank 2 holds no row of used.weight
    for rank, r in enumerate(results):
        rows = 0 if rank == 2 else 1
        once = [("used.bias", True, (rows,)), ("used.weight", True, (rows, 4))]
        # none without sync, once per parameter per synchronising backward, never for the unused head
        assert r["per_backward"] == [[], [], once, once]


def optimizer_in_backward(rank: int, world_size: int, before: bool) -> dict:
    """TinyNet trained with one AdamW per parameter, stepped inside the parameter's post-accumulate-grad
    hook; ``world_size`` 0: one process on the global batch. ``before``: hooks and optimizers built before
    ``fully_shard`` (the optimizers are retargeted at their first step, ``perparam.runtime.adopt``)."""
    torch.manual_seed(0)
    model = TinyNet()

    def step_in_backward(opt: torch.optim.Optimizer):
        def hook(_p: torch.Tensor) -> None:
            opt.step()
            opt.zero_grad()
        return hook

    def install() -> None:
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(step_in_backward(torch.optim.AdamW([p], lr=1e-2)))

    if before or not world_size:
        install()
    if world_size:
        for block in model.blocks:
            perparam.fully_shard(block)
        perparam.fully_shard(model)
        if not before:
            install()
    for x, y in make_batches(3, 4):
        if world_size:
            x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        F.mse_loss(model(x), y).backward()
    return {"params": {n: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
                       for n, p in model.named_parameters()},
            "grads_left": [n for n, p in model.named_parameters() if p.grad is not None]}


@pytest.mark.fast
@pytest.mark.parametrize("before", [False, True], ids=["registered_after", "registered_before_fully_shard"])
def test_an_optimizer_stepped_in_the_hooks_matches_one_process(before):
    want = optimizer_in_backward(0, 0, before)
    for got in run_distributed(optimizer_in_backward, 2, before):
        assert got["grads_left"] == []  # every hook ran its optimizer's zero_grad
        for name, value in want["params"].items():
            torch.testing.assert_close(got["params"][name], value, atol=1e-5, rtol=0, msg=name)


def hooked_before_sharding(rank: int, world_size: int) -> str:
    model = nn.Linear(4, 2)
    model.weight.register_hook(lambda g: g)
    try:
        perparam.fully_shard(model)
    except perparam.ShardingError as e:
        return str(e) + f" | sharded: {isinstance(model.weight, DTensor)}"
    return "no error"


def test_a_register_hook_hook_on_a_parameter_is_refused_at_fully_shard():
    (message,) = run_distributed(hooked_before_sharding, 1)
    assert ("'weight'" in message and "register_hook" in message
            and "register_post_accumulate_grad_hook" in message)
    assert message.endswith("sharded: False")  # nothing changed
