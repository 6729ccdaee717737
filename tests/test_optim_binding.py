"""One binding per optimizer (``perparam.runtime.optim``): its step hooks run the stages in order and undo
them in reverse, once per step whatever the nesting; a step whose step proper raised is undone before the
next one; a gradient's kind is asked once per parameter per step; and nothing is written on the user's
optimizer."""

from __future__ import annotations

import torch
from torch import nn

import perparam
from perparam import ParamPolicy
from perparam.runtime import owner_grads
from perparam.runtime.optim.registry import REGISTRY, binding_of
from tests.distributed import run_distributed


class _Recording:
    """A stage added to one optimizer's binding: logs its calls."""

    first = False

    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def before(self, step, binding) -> None:
        self.log.append(("before", self.name))

    def after(self, step, binding) -> None:
        self.log.append(("after", self.name, step.completed))


class _RaisingSGD(torch.optim.SGD):
    """SGD whose step proper raises while ``defaults["raise_now"]``, else calls its parent's (hooked) step."""

    def step(self, closure=None):
        if self.defaults.get("raise_now"):
            raise FloatingPointError("NaN in the update")
        return super().step(closure)


def _model(policy: ParamPolicy | None = None) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))  # 3 and 2 rows: uneven, and empty at K = 3
    perparam.fully_shard(model, param_policy={"*.weight": policy} if policy is not None else None)
    return model


def _backward(model: nn.Module, rank: int, world_size: int, step: int) -> None:
    x = torch.randn(2 * world_size, 4, generator=torch.Generator().manual_seed(step))[2 * rank:2 * rank + 2]
    model(x).pow(2).sum().backward()


def _stages_in_order(rank: int, world_size: int) -> dict:
    # SGD.step hooked: a subclass's super() nests
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    model = _model()
    opt = _RaisingSGD(model.parameters(), lr=0.1)
    log, out = [], {}
    _backward(model, rank, world_size, 0)
    opt.step()  # binds it
    binding = binding_of(opt)
    binding.stages += [_Recording(log, "a"), _Recording(log, "b")]  # a new stage: one class, one entry
    opt.zero_grad()
    _backward(model, rank, world_size, 1)
    opt.step()  # the subclass's super().step() runs perparam's hooks again, inside the step proper
    out["nested"] = list(log)
    log.clear()
    opt.defaults["raise_now"] = True
    _backward(model, rank, world_size, 2)
    try:
        opt.step()
    except FloatingPointError:
        pass
    out["raised"] = list(log)
    log.clear()
    opt.defaults["raise_now"] = False
    opt.zero_grad()
    _backward(model, rank, world_size, 3)  # a root forward: the raising step is over
    opt.step()
    out["after_raise"] = list(log)
    out["open"] = binding.depth
    out["in_groups"] = all(isinstance(p, torch.distributed.tensor.DTensor) for g in opt.param_groups
                           for p in g["params"])
    return out


def test_the_stages_run_in_order_once_per_step_and_a_raising_step_is_undone_before_the_next():
    for r in run_distributed(_stages_in_order, 2):
        once = [("before", "a"), ("before", "b"), ("after", "b", True), ("after", "a", True)]
        assert r["nested"] == once, r["nested"]
        assert r["raised"] == [("before", "a"), ("before", "b")], r["raised"]
        assert r["after_raise"] == [("after", "b", False), ("after", "a", False)] + once, r["after_raise"]
        assert r["open"] == 0 and r["in_groups"]


def _kinds_and_attributes(rank: int, world_size: int) -> dict:
    previous = perparam.configure(owner_grad="owner")
    try:
        model = _model(ParamPolicy(update="owner"))
        opts = [torch.optim.Muon([m.weight for m in model], lr=0.02),
                torch.optim.AdamW([m.bias for m in model], lr=0.01)]
        before = [set(vars(o)) for o in opts]
        asked, original = [], owner_grads.at_owner
        owner_grads.at_owner = lambda sp, *grad: (asked.append(sp.fqn), original(sp, *grad))[1]
        try:
            per_step = []
            for step in range(3):
                _backward(model, rank, world_size, step)
                asked.clear()
                for o in opts:
                    o.step()
                    o.zero_grad()
                per_step.append(sorted(asked))
        finally:
            owner_grads.at_owner = original
        return {"asked": per_step, "new_attributes": [sorted(set(vars(o)) - b) for o, b in zip(opts, before)],
                "bound": sum(1 for o in opts if o in REGISTRY.bindings)}
    finally:
        perparam.configure(owner_grad=previous.owner_grad)


def test_a_gradients_kind_is_asked_once_per_parameter_per_step_and_the_optimizer_gets_no_attribute():
    for r in run_distributed(_kinds_and_attributes, 2):
        assert r["asked"] == [["0.weight", "1.weight"]] * 3, r["asked"]  # each owner parameter once
        assert r["new_attributes"] == [[], []] and r["bound"] == 2, r


#: perparam's Python calls in one optimizer step at steady state (rank 0 of 2, ``owner_cases.recipe``:
#: stock Muon on the blocks' 4 hidden matrices under update="owner", AdamW on the other 11 parameters),
#: counted by ``sys.setprofile``. Before ``runtime/optim/``: 266 and 75; with it, first: 298 and 110; each
#: gradient read and its kind decided once per step, ``param_groups`` narrowed once per bucket: 278 and 65.
STEP_CALLS = {"Muon": 278, "AdamW": 65}


def _step_calls(rank: int, world_size: int) -> list[dict]:
    import os
    import sys

    import torch.nn.functional as F

    from tests.models import make_batches
    from tests.owner_cases import recipe

    package = os.path.dirname(perparam.__file__) + os.sep
    model, opts = recipe(rank, world_size)
    per_step = []
    for idx, y in make_batches(3, 12):
        F.mse_loss(model(idx[rank * 6:(rank + 1) * 6]), y[rank * 6:(rank + 1) * 6]).backward()
        counts = {}
        for opt in opts:
            calls = [0]

            def profile(frame, event, arg, calls=calls) -> None:
                if event == "call" and frame.f_code.co_filename.startswith(package):
                    calls[0] += 1

            sys.setprofile(profile)
            try:
                opt.step()
            finally:
                sys.setprofile(None)
            counts[type(opt).__name__] = calls[0]
            opt.zero_grad()
        per_step.append(counts)
    return per_step


def test_an_optimizer_steps_bookkeeping_stays_within_its_call_count():
    steady = run_distributed(_step_calls, 2)[0][-1]  # (the first step binds, plans and checks: more)
    assert all(steady[name] <= most for name, most in STEP_CALLS.items()), (steady, STEP_CALLS)
