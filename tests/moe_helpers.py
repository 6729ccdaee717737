"""Mixture of experts with expert parallelism, shared by ``test_expert_parallel.py`` and
``test_param_mesh.py``: dense ``pre``/``post`` around ``EXPERTS`` experts, expert e on the ranks of
expert-parallel coordinate e, tokens routed to their expert and back with a differentiable all-to-all;
the reference runs both experts in one process on the global batch (the loss the mean of the ranks').
Test files import this module as ``moe`` (``moe.build()``, ``moe.train(...)``), not name by name."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.nn.functional import all_to_all_single

from perparam import CommCounter

D, EXPERTS, TOKENS, STEPS, TOL = 4, 2, 6, 3, 1e-5  # TOKENS per rank


def build() -> tuple[nn.Linear, list[nn.Linear], nn.Linear]:
    torch.manual_seed(0)
    return nn.Linear(D, D), [nn.Linear(D, D) for _ in range(EXPERTS)], nn.Linear(D, 2)


def batches(ranks: int = 2) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per step: tokens ``[ranks * TOKENS, D]``, targets ``[ranks * TOKENS, 2]``, expert ids
    ``[ranks * TOKENS]`` (rank r's tokens are rows ``r * TOKENS ..``; some go to an expert elsewhere)."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(ranks * TOKENS, D, generator=g), torch.randn(ranks * TOKENS, 2, generator=g),
             torch.randint(0, EXPERTS, (ranks * TOKENS,), generator=g)) for _ in range(STEPS)]


class ExpertParallelMoE(nn.Module):
    """``pre`` -> each token to the expert of its id (expert e on the rank of coordinate e of ``group``, the
    expert-parallel group; ``None``: the world) and back -> ``post``. ``expert_name``: the attribute the
    expert is registered under."""

    def __init__(self, pre: nn.Linear, expert: nn.Linear, post: nn.Linear, group=None,
                 expert_name: str = "expert") -> None:
        super().__init__()
        self.pre, self.post = pre, post
        setattr(self, expert_name, expert)
        self.group, self.expert_name = group, expert_name

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:  # [T, D], [T] -> [T, 2]
        h = self.pre(x)
        order = torch.argsort(route, stable=True)
        send = torch.bincount(route, minlength=EXPERTS)  # tokens to each rank's expert
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send, recv = send.tolist(), recv.tolist()
        group = self.group or dist.group.WORLD
        tokens = all_to_all_single(h.new_empty(sum(recv), D), h[order], recv, send, group=group)
        back = all_to_all_single(h.new_empty(len(route), D), getattr(self, self.expert_name)(tokens), send,
                                 recv, group=group)
        return self.post(torch.relu(back[torch.argsort(order)]))


def expert_parallel_model(expert: int, group=None) -> ExpertParallelMoE:
    """``build()``'s block with expert ``expert`` (the one on this rank) as its ``expert``; ``group``: the
    expert-parallel group (``None``: the world)."""
    pre, experts, post = build()
    return ExpertParallelMoE(pre, experts[expert], post, group=group)


def train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, expert: int, ranks: int = 2,
          after_first_backward: Callable[[], None] | None = None,
          after_step: Callable[[], None] | None = None) -> dict:
    """``STEPS`` steps of ``model`` (an ``ExpertParallelMoE`` holding expert ``expert``) on rank ``rank``'s
    tokens of ``batches(ranks)``: backward of the MSE loss, ``opt.step()``, ``opt.zero_grad()``. Returns the
    first step's full gradients (``grads``) and the full parameters after the steps (``params``), under
    the reference's names (the expert as ``experts.<expert>.*``), and each step's collectives as a
    ``Counter`` of (kind, group size) (``counts``)."""
    named = {n.replace("expert.", f"experts.{expert}."): p for n, p in model.named_parameters()}
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
    grads, counts = None, []
    for x, y, route in batches(ranks):
        with CommCounter() as comm:
            F.mse_loss(model(x[mine], route[mine]), y[mine]).backward()
        counts.append(Counter((r.kind, r.group_size) for r in comm.records))
        if grads is None:
            grads = {n: p.grad.full_tensor() for n, p in named.items()}
            if after_first_backward is not None:
                after_first_backward()
        opt.step()
        if after_step is not None:
            after_step()
        opt.zero_grad()
    return {"grads": grads, "params": {n: p.full_tensor().clone() for n, p in named.items()},
            "counts": counts}


class ReferenceMoE(nn.Module):
    """Both experts in one process: token i goes through ``experts[route[i]]``."""

    def __init__(self, pre: nn.Linear, experts: list[nn.Linear], post: nn.Linear) -> None:
        super().__init__()
        self.pre, self.experts, self.post = pre, nn.ModuleList(experts), post

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        out = torch.where(route[:, None] == 0, self.experts[0](h), self.experts[1](h))
        return self.post(torch.relu(out))


def make_optimizer(params, name: str) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2) if name == "adamw" else torch.optim.SGD(params, lr=0.1)


def reference(name: str, ranks: int = 2) -> dict:
    """One process, global batch of ``ranks`` ranks; the loss is the mean of the ranks' losses. Returns the
    first step's gradients and the parameters after ``STEPS`` steps."""
    pre, experts, post = build()
    model = ReferenceMoE(pre, experts, post)
    opt = make_optimizer(model.parameters(), name)
    grads = None
    for x, y, route in batches(ranks):
        losses = [F.mse_loss(model(x[r * TOKENS:(r + 1) * TOKENS], route[r * TOKENS:(r + 1) * TOKENS]),
                             y[r * TOKENS:(r + 1) * TOKENS]) for r in range(ranks)]
        (sum(losses) / ranks).backward()
        grads = grads or {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return {"grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def assert_matches(got: dict, want: dict, tol: float = TOL) -> None:
    for name, value in got.items():
        torch.testing.assert_close(value, want[name], atol=tol, rtol=0, msg=name)
