"""``torch.optim`` SGD/Adam/AdamW steps on perparam parameters run on the local shards
(``perparam.runtime.local_step``): bitwise the update DTensor's dispatch gives, with the optimizer's state
DTensors of the parameter's placements outside the step, on uneven and empty shards."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

import perparam
from perparam.runtime import local_step
from perparam.runtime.optim.registry import binding_of
from perparam.runtime.optim.stages import LocalSwap
from tests.distributed import run_distributed

pytestmark = pytest.mark.fast


def _train(rank: int, world_size: int, local: bool, make_opt, closure: bool = False,
           hooks: bool = False) -> dict:
    previous = perparam.configure(local_optimizer_step=local)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 2), nn.Linear(2, 5))  # 3 ranks: rows 1/1/0 and 2/2/1
        perparam.fully_shard(model[0])
        perparam.fully_shard(model)
        opt = make_opt(model.parameters())
        swapped = []  # the swap in progress after each step: None (undone)
        seen = []  # parameters stepped on their local tensors, per step
        original = local_step.swap_out
        local_step.swap_out = lambda o, records: (seen.append(len(records or ())), original(o, records))
        hooks_saw = []  # hooks=True: whether the user's step hooks found DTensor parameters in the optimizer

        def user_hook(o, args, kwargs, zero=False):
            hooks_saw.append(all(isinstance(p, DTensor) for group in o.param_groups for p in group["params"]))
            if zero:
                o.zero_grad()

        if hooks:  # registered before the first step (which installs perparam's), and one after it
            opt.register_step_post_hook(lambda o, a, k: user_hook(o, a, k, zero=True))
        g = torch.Generator().manual_seed(1)
        for step in range(3):
            x = torch.randn(2 * world_size, 4, generator=g)[2 * rank:2 * rank + 2]
            if hooks and step == 1:
                opt.register_step_pre_hook(user_hook)

            def loss(x=x):
                if not hooks:  # else the post-hook zeroes the gradients
                    opt.zero_grad(set_to_none=True)
                model(x).pow(2).sum().backward()

            if closure:  # the gradients are computed inside step(), after its pre-hooks
                opt.step(loss)
            else:
                loss()
                opt.step()
            swapped.append(next(s.records for s in binding_of(opt).stages if isinstance(s, LocalSwap)))
        state = {name: {k: v for k, v in opt.state[p].items()} for name, p in model.named_parameters()}
        return {"params": [p.to_local().clone() for p in model.parameters()],
                "kinds": sorted({type(v).__name__ for s in state.values() for v in s.values()}),
                "state": {n: {k: (v.to_local() if isinstance(v, DTensor) else v).clone()
                              for k, v in s.items()}
                          for n, s in state.items()},
                "placements": {n: [tuple(v.placements) for v in s.values() if isinstance(v, DTensor)]
                               for n, s in state.items()},
                "param_placements": {n: tuple(p.placements) for n, p in model.named_parameters()},
                "in_groups": all(isinstance(p, DTensor) for g in opt.param_groups for p in g["params"]),
                "after_step": swapped, "seen": seen, "hooks_saw": hooks_saw}
    finally:
        local_step.swap_out = original
        perparam.configure(local_optimizer_step=previous.local_optimizer_step)


def _adamw(params):
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def both_steps(rank: int, world_size: int) -> dict:
    out = {(name, local): _train(rank, world_size, local, make)
           for name, make in (("adamw", _adamw), ("sgd", _sgd)) for local in (False, True)}
    out["sgd closure", True] = _train(rank, world_size, True, _sgd, closure=True)
    out["sgd hooks", True] = _train(rank, world_size, True, _sgd, hooks=True)
    out["0-dim"] = {local: _zero_dim_state_kinds(local) for local in (False, True)}
    return out


class _Scaled(nn.Linear):
    """``Linear(4, 3)`` times a 0-dim parameter."""

    def __init__(self) -> None:
        super().__init__(4, 3)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


def _zero_dim_state_kinds(local: bool) -> dict:
    """Adam on a model with a 0-dim (replicated) parameter: the type of each state value after 2 steps."""
    previous = perparam.configure(local_optimizer_step=local)
    try:
        torch.manual_seed(0)
        model = _Scaled()
        perparam.fully_shard(model, param_policy={"scale": perparam.ParamPolicy(placement=Replicate())})
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        return {n: {k: type(v).__name__ for k, v in opt.state[p].items()}
                for n, p in model.named_parameters()}
    finally:
        perparam.configure(local_optimizer_step=previous.local_optimizer_step)


@functools.cache
def _results() -> tuple[dict, ...]:
    return tuple(run_distributed(both_steps, 3))


def test_sgd_and_adamw_steps_on_local_shards_equal_dtensor_steps_bitwise_with_dtensor_state():
    for res in _results():
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


def test_a_step_with_a_closure_runs_on_dtensors_and_trains_as_without_a_closure():
    # step(closure): the closure's zero_grad() and backward ran while the optimizer held the local tensors,
    # so the step saw no gradient and never updated anything (silently) before closures were left to DTensors
    for res in _results():
        got, want = res[("sgd closure", True)], res[("sgd", False)]
        assert all(torch.equal(a, b) for a, b in zip(got["params"], want["params"]))
        assert got["seen"] == [0] * 3 and got["after_step"] == [None] * 3


def test_the_users_step_hooks_see_dtensor_parameters_and_a_zero_grad_post_hook_trains_as_a_loop():
    # a post-hook registered before the first step (zero_grad() in it) ran before the swap-out and zeroed
    # the local tensors' .grad, so the DTensor gradients accumulated over the steps; a pre-hook registered
    # after the first step ran after the swap-in: that step runs on DTensors, the next on local shards again
    for res in _results():
        got, want = res[("sgd hooks", True)], res[("sgd", False)]
        assert all(torch.equal(a, b) for a, b in zip(got["params"], want["params"]))
        assert got["hooks_saw"] == [True] * 5, got["hooks_saw"]  # post x 3, pre x 2
        assert got["seen"] == [4, 0, 4], got["seen"]


def test_a_zero_dim_parameters_adam_step_count_stays_a_plain_tensor_as_on_the_dtensor_path():
    # a 0-dim parameter's local shape is (), the step count's too: it was wrapped as a DTensor
    for res in _results():
        assert res["0-dim"][True] == res["0-dim"][False], res["0-dim"]
