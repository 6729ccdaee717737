"""``optimizer.zero_grad(set_to_none=False)`` (gradients zeroed in place, not dropped) trains bitwise like
``set_to_none=True`` on owner parameters (``ParamPolicy(update="owner")``) under both ``owner_grad``
settings, accumulation without sync after it included, and on ZeRO stage 1/2 parameters: every rank decides
alike whether a backward accumulates onto the held gradient or starts afresh."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import perparam
from perparam import ParamPolicy
from perparam.runtime import owner_grads, owner_step
from tests.distributed import run_distributed
from tests.models import TinyNet, full_params, make_batches


def _policy(stage: int | None):
    """Owner policy on the blocks' hidden matrices (``stage``: their ``zero_stage``), or, ``stage`` given
    as ``-1``/``-2``, plain ZeRO stage 1/2 (no owner) on every parameter."""
    if stage is not None and stage < 0:
        return lambda name, p: ParamPolicy(zero_stage=-stage)
    kw = {} if stage is None else {"zero_stage": stage}
    return lambda name, p: ParamPolicy(update="owner", **kw) if name in ("fc1.weight", "fc2.weight") else None


def _train(rank: int, world_size: int, owner_grad: str, set_to_none, stage: int | None = None,
           micro: int = 1, hsdp: bool = False) -> dict:
    """TinyNet: Muon on the blocks' 2-D matrices, AdamW on the rest, 3 steps of the global batch 12 (``micro``
    micro-batches each, the first ``micro - 1`` without gradient sync), ``zero_grad(set_to_none=...)`` after
    each step (``set_to_none="foreach"``: ``torch._foreach_zero_`` over the ``.grad``s instead, as an
    optimizer built with ``foreach=True`` zeroes them: no version counter of a DTensor moves). ``hsdp``: on
    a 2x2 (replicate, shard) mesh, the first micro-batches held without the replicas' all-reduce
    (``set_requires_all_reduce(False)``) instead of unsynced."""
    previous = perparam.configure(owner_grad=owner_grad)
    try:
        torch.manual_seed(0)
        model = TinyNet(d=6)
        mesh = None
        if hsdp:
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        for block in model.blocks:
            perparam.fully_shard(block, mesh=mesh, param_policy=_policy(stage))
        perparam.fully_shard(model, mesh=mesh, param_policy=_policy(stage))
        named = dict(model.named_parameters())
        hidden = [p for n, p in named.items()
                  if n.startswith("blocks") and n.endswith("weight") and p.ndim == 2]
        rest = [p for p in named.values() if all(p is not h for h in hidden)]
        if stage is not None and stage < 0:
            opts = [torch.optim.AdamW(named.values(), lr=0.01, weight_decay=0.01)]
        else:
            opts = [torch.optim.Muon(hidden, lr=0.02, weight_decay=0.1),
                    torch.optim.AdamW(rest, lr=0.01, weight_decay=0.01)]
        share = 12 // world_size
        to_owner = []  # per step: the owner matrices' gradients were reduced to their owners
        batches = make_batches(3 * micro, 12)
        for step in range(3):
            for i in range(micro):
                idx, y = batches[step * micro + i]
                idx, y = idx[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
                getattr(model,
                        "set_requires_all_reduce" if hsdp else "set_requires_gradient_sync")(i == micro - 1)
                (F.mse_loss(model(idx), y) / micro).backward()
            route = owner_step.routing(opts[0])
            to_owner.append(route is not None
                            and all(owner_grads.at_owner(e.sp) for e in route.by_id.values()))
            for opt in opts:
                opt.step()
            if set_to_none == "foreach":
                torch._foreach_zero_([p.grad for p in model.parameters() if p.grad is not None])
            else:
                for opt in opts:
                    opt.zero_grad(set_to_none=set_to_none)
        return {**full_params(model), "to_owner": torch.tensor(to_owner)}
    finally:
        perparam.configure(owner_grad=previous.owner_grad)


def _both(rank: int, world_size: int, owner_grad: str, stage, micro: int, hsdp: bool = False) -> list[dict]:
    return [_train(rank, world_size, owner_grad, s, stage, micro, hsdp) for s in (True, False, "foreach")]


def _assert_bitwise(results: list) -> None:
    for dropped, *zeroed in results:
        for how, got in zip(("zero_grad(set_to_none=False)", "foreach"), zeroed):
            for name, want in dropped.items():  # the bits, signed zeros included
                assert torch.equal(got[name].view(want.dtype if name == "to_owner" else torch.int32),
                                   want.view(want.dtype if name == "to_owner" else torch.int32)), (
                    how, name, (got[name] - want).abs().max().item())


@pytest.mark.fast
def test_zero_grad_in_place_trains_bitwise_like_set_to_none_with_gradients_reduced_to_owners():
    for world_size in (2, 3):  # K = 3: uneven (13 rows: 5/4/4) and empty shards (Embedding(5), Linear(6, 2))
        _assert_bitwise(run_distributed(_both, world_size, "owner", None, 1))
    # accumulation without sync onto the zeroed gradients
    results = run_distributed(_both, 2, "owner", None, 2)
    _assert_bitwise(results)
    assert all(r[1]["to_owner"].tolist() == [False, True, True] for r in results)  # planned at the first step


def test_zero_grad_in_place_on_hsdp_with_held_reductions_trains_bitwise_like_set_to_none():
    # the zeroed flags summed over the replicas too, and held over the micro-batches (runtime/partial.py)
    _assert_bitwise(run_distributed(_both, 4, "owner", None, 2, True))


@pytest.mark.parametrize("case", [("rows", None, 1), ("rows", None, 2), ("owner", 1, 1), ("owner", 2, 2),
                                  ("rows", -1, 2), ("rows", -2, 2)],
                         ids=["rows", "rows-nosync", "owner-stage1", "owner-stage2-nosync",
                              "zero1-nosync", "zero2-nosync"])
def test_zero_grad_in_place_trains_bitwise_like_set_to_none(case):
    _assert_bitwise(run_distributed(_both, 2, *case))


def _matrices(rank: int, world_size: int, owner_grad: str, how: str) -> dict:
    """Linear(8, 6), Linear(6, 5), Linear(5, 2) without bias, Muon on all three as owner parameters, 3 steps;
    at K = 3 the owners are ranks 0, 1, 2 (largest Newton-Schulz cost first) and rank 2 holds no rows of the
    2 x 5 matrix it owns, so only its peers can see that its ``.grad`` was zeroed. ``how``: "none"
    (``zero_grad()``), "zero" (``zero_grad(set_to_none=False)``), "foreach" (``torch._foreach_zero_`` over the
    ``.grad``s, as an optimizer built with ``foreach=True`` zeroes: no version counter moves), "keep"
    (no zeroing at all: accumulated over the steps), "between" ("foreach", and at the last step also between
backward and the step: the owner without rows learns it from its peers' witness in the gather). Returns the
bits of the parameters and the owners."""
    previous = perparam.configure(owner_grad=owner_grad)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 6, bias=False), torch.nn.Linear(6, 5, bias=False),
                                    torch.nn.Linear(5, 2, bias=False))
        policy = ParamPolicy(update="owner")
        for layer in model:
            perparam.fully_shard(layer, param_policy=policy)
        perparam.fully_shard(model, param_policy=policy)
        opt = torch.optim.Muon(model.parameters(), lr=0.02)
        g = torch.Generator().manual_seed(1)
        for step in range(3):
            x = torch.randn(3 * world_size, 8, generator=g)[3 * rank:3 * rank + 3]
            model(x).pow(2).sum().backward()
            if how == "between" and step == 2:  # zeroed after backward, before the step: a step on zeros
                torch._foreach_zero_([p.grad for p in model.parameters()])
            opt.step()
            if how == "none":
                opt.zero_grad()
            elif how == "zero":
                opt.zero_grad(set_to_none=False)
            elif how in ("foreach", "between"):
                torch._foreach_zero_([p.grad for p in model.parameters()])
        route = owner_step.routing(opt)
        owners = [route.by_id[id(p)].owner for p in model.parameters()]
        return {"params": {n: v.view(torch.int32) for n, v in full_params(model).items()}, "owners": owners,
                "rows": [p.to_local().shape[0] for p in model.parameters()]}
    finally:
        perparam.configure(owner_grad=previous.owner_grad)


def _zeroings(rank: int, world_size: int) -> dict:
    return {(grad, how): _matrices(rank, world_size, grad, how) for grad in ("owner", "rows")
            for how in ("none", "zero", "foreach", "keep", "between")}


def test_a_gradient_zeroed_in_place_on_an_owner_with_no_rows_of_it_is_seen_by_its_peers():
    results = run_distributed(_zeroings, 3)
    assert results[2]["owner", "none"]["owners"] == [0, 1, 2]
    assert [r["owner", "none"]["rows"][2] for r in results] == [1, 1, 0]  # the owner of 2 x 5 has no rows
    for r in results:
        want = r["owner", "none"]["params"]
        for case in (("owner", "zero"), ("owner", "foreach"), ("rows", "none"), ("rows", "zero"),
                     ("rows", "foreach")):
            for name in want:  # the bits, signed zeros included
                assert torch.equal(r[case]["params"][name], want[name]), (case, name)
        for name, bits in r["rows", "between"]["params"].items():  # a step on zeroed gradients, either route
            assert torch.equal(r["owner", "between"]["params"][name], bits), name
        # gradients accumulated over the steps (never zeroed): onto the whole the first step assembled, as the
        # reduce-scatter route accumulates its rows (before: the second backward raised OwnerStepError)
        for name, bits in r["rows", "keep"]["params"].items():
            got = r["owner", "keep"]["params"][name].view(torch.float32)
            assert (got - bits.view(torch.float32)).abs().max().item() <= 1e-6, name
