"""``torch.optim`` SGD/Adam/AdamW steps on perparam parameters run on the local shards
(``perparam.runtime.local_step``): bitwise the update DTensor's dispatch gives, with the optimizer's state
DTensors of the parameter's placements outside the step, on uneven and empty shards."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

import perparam
from perparam.runtime import local_step
from tests.distributed import run_distributed


def _train(rank: int, world_size: int, local: bool, make_opt) -> dict:
    previous = perparam.configure(local_optimizer_step=local)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 2), nn.Linear(2, 5))  # 3 ranks: rows 1/1/0 and 2/2/1
        perparam.fully_shard(model[0])
        perparam.fully_shard(model)
        opt = make_opt(model.parameters())
        swapped = []  # the swap in progress after each step: None (undone)
        seen = []  # parameters stepped on their local tensors, per step
        original = local_step._swap_out
        local_step._swap_out = lambda o: (seen.append(len(getattr(o, local_step._ATTR) or ())), original(o))
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(2 * world_size, 4, generator=g)[2 * rank:2 * rank + 2]
            opt.zero_grad(set_to_none=True)
            model(x).pow(2).sum().backward()
            opt.step()
            swapped.append(getattr(opt, local_step._ATTR, "absent"))
        state = {name: {k: v for k, v in opt.state[p].items()} for name, p in model.named_parameters()}
        return {"params": [p.to_local().clone() for p in model.parameters()],
                "kinds": sorted({type(v).__name__ for s in state.values() for v in s.values()}),
                "state": {n: {k: (v.to_local() if isinstance(v, DTensor) else v).clone() for k, v in s.items()}
                          for n, s in state.items()},
                "placements": {n: [tuple(v.placements) for v in s.values() if isinstance(v, DTensor)]
                               for n, s in state.items()},
                "param_placements": {n: tuple(p.placements) for n, p in model.named_parameters()},
                "in_groups": all(isinstance(p, DTensor) for g in opt.param_groups for p in g["params"]),
                "after_step": swapped, "seen": seen}
    finally:
        local_step._swap_out = original
        perparam.configure(local_optimizer_step=previous.local_optimizer_step)


def _adamw(params):
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def both_steps(rank: int, world_size: int) -> dict:
    return {(name, local): _train(rank, world_size, local, make)
            for name, make in (("adamw", _adamw), ("sgd", _sgd)) for local in (False, True)}


def test_sgd_and_adamw_steps_on_local_shards_equal_dtensor_steps_bitwise_with_dtensor_state():
    for res in run_distributed(both_steps, 3):
        for name in ("adamw", "sgd"):
            dt, loc = res[(name, False)], res[(name, True)]
            assert all(torch.equal(a, b) for a, b in zip(dt["params"], loc["params"])), name
            assert dt["state"].keys() == loc["state"].keys()
            for key in dt["state"]:
                assert dt["state"][key].keys() == loc["state"][key].keys()
                assert all(torch.equal(dt["state"][key][k], loc["state"][key][k]) for k in dt["state"][key])
            # outside the step the optimizer holds what it holds on the DTensor path: DTensor parameters,
            # DTensor state of the parameter's placements (and a plain step count for AdamW)
            assert loc["kinds"] == dt["kinds"] and loc["in_groups"] and loc["after_step"] == [None] * 3
            assert loc["seen"] == [4] * 3 and dt["seen"] == [0] * 3  # 4 parameters stepped on local shards
            for key, placements in loc["placements"].items():
                assert placements == dt["placements"][key]
                assert all(p == loc["param_placements"][key] for p in placements)
