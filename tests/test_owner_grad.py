"""``perparam.configure(owner_grad="owner")`` (gradients of ``update="owner"`` parameters reduced straight to
their owner) with what else reads or accumulates gradients: HSDP's held all-reduce and accumulation without
sync train like one process; a ``.grad`` changed after backward (torch's clip, an unscale, ``mul_``) is
refused at the step on every rank, naming ``perparam.clip_grad_norm_``; ZeRO stages, a frozen head, qgZ,
experts on their own mesh and ``InvariantUnits`` give what the default route gives."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import perparam
from perparam import ParamPolicy
from perparam.runtime import owner_grads, owner_step
from tests.distributed import one_process, run_distributed
from tests.models import TinyNet, full_params, make_batches
from tests.owner_cases import OWNER, compose, hidden_owner, max_diff, recipe


def _share(rank: int, world_size: int, idx, y):
    n = 12 // (world_size or 1)
    return (idx, y) if not world_size else (idx[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])


MODES = ("hold", "nosync", "unfreeze")


def _accumulate(rank: int, world_size: int, mode: str) -> dict:
    """TinyNet's Muon + AdamW recipe, 4 steps of 2 micro-batches (global 12 each), on an HSDP 2x2 mesh when
    distributed; ``mode``: "hold" (``set_requires_all_reduce`` only on the last micro-batch), "nosync"
    (``set_requires_gradient_sync`` likewise), "unfreeze" ("hold", blocks[0].fc1.weight frozen in the first
    micro-batch: it joins the held reduction in the second). Returns the parameters and, per step after the
    first, whether the owner matrices' gradients were reduced to their owners."""
    model, opts = recipe(rank, world_size, None, (2, 2) if world_size else None)
    batches, to_owner = make_batches(8, 12), []
    for step in range(4):
        for i in range(2):
            if mode == "unfreeze":  # an owner matrix frozen in the first micro-batch, trained in the second
                model.blocks[0].fc1.weight.requires_grad_(i == 1)
            if world_size:
                setting = "set_requires_gradient_sync" if mode == "nosync" else "set_requires_all_reduce"
                getattr(model, setting)(i == 1)
            idx, y = _share(rank, world_size, *batches[2 * step + i])
            (F.mse_loss(model(idx), y) / 2).backward()
        route = owner_step.routing(opts[0])
        if world_size and route is not None:
            to_owner.append(all(owner_grads.at_owner(e.sp) for e in route.by_id.values()))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return {"params": full_params(model), "to_owner": to_owner}


def _norm_at_second_step(rank: int, world_size: int) -> float:
    """The gradient norm before the second step (the first one reduced to the owners), one process:
    torch's."""
    model, opts = recipe(rank, world_size)
    for step, (idx, y) in enumerate(make_batches(2, 12)):
        idx, y = _share(rank, world_size, idx, y)
        F.mse_loss(model(idx), y).backward()
        if step == 1:
            clip = perparam.clip_grad_norm_ if world_size else torch.nn.utils.clip_grad_norm_
            return float(clip(list(model.parameters()), float("inf")))
        for opt in opts:
            opt.step()
            opt.zero_grad()


def _changed_grad(rank: int, world_size: int, how: str) -> str:
    """The second step after ``how`` changed the gradients: "torch_clip" (``torch.nn.utils.clip_grad_norm_``),
    "unscale" (``p.grad.mul_``, as a GradScaler's unscale), "hook" (a post-accumulate-grad hook halving
    ``.grad``); with "+clip", ``perparam.clip_grad_norm_`` after it (the AMP recipe: unscale, then clip),
    which must not take the changed rows as its own. Returns the step's error text."""
    model, opts = recipe(rank, world_size)
    for step, (idx, y) in enumerate(make_batches(2, 12)):
        if how == "hook" and step == 1:
            for p in model.parameters():
                p.register_post_accumulate_grad_hook(lambda p: p.grad.mul_(0.5))
        idx, y = _share(rank, world_size, idx, y)
        F.mse_loss(model(idx), y).backward()
        if step == 1 and how.startswith("torch_clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        if step == 1 and how.startswith("unscale"):
            for p in model.parameters():
                p.grad.mul_(0.5)
        if step == 1 and how.endswith("+clip"):
            perparam.clip_grad_norm_(list(model.parameters()), 1.0)
        try:
            for opt in opts:
                opt.step()
                opt.zero_grad()
        except owner_step.OwnerStepRaised as e:
            return str(e)
    return "no error"


CHANGES = ("torch_clip", "unscale", "hook", "unscale+clip", "torch_clip+clip")


def _hsdp_cases(rank: int, world_size: int) -> dict:
    previous = perparam.configure(owner_grad="owner")
    try:
        out = {mode: _accumulate(rank, world_size, mode) for mode in MODES}
        out["norm"] = _norm_at_second_step(rank, world_size)
        out.update({how: _changed_grad(rank, world_size, how) for how in CHANGES})
        return out
    finally:
        perparam.configure(owner_grad=previous.owner_grad)


def test_accumulation_held_or_unsynced_trains_like_one_process_and_a_changed_grad_is_refused_at_the_step():
    want = {mode: one_process(_accumulate, mode)["params"] for mode in MODES}
    norm = one_process(_norm_at_second_step)
    for r in run_distributed(_hsdp_cases, 4):  # HSDP 2x2
        for mode in MODES:
            assert max_diff(r[mode]["params"], want[mode]) <= 1e-5, (mode,
                                                                     max_diff(r[mode]["params"], want[mode]))
            assert r[mode]["to_owner"] == [True] * 3  # every step after the first reduced to the owners
        # perparam.clip_grad_norm_(inf): the norm, unchanged grads
        assert abs(r["norm"] - norm) <= 1e-5 * norm
        for how in CHANGES:
            assert "perparam.clip_grad_norm_" in r[how] and "owner_grad='owner'" in r[how], (how, r[how])
            assert "'blocks.0.fc1.weight'" in r[how]  # its path in the model


def _composed(rank: int, world_size: int) -> dict:
    previous = perparam.configure(owner_grad="owner")
    try:
        return {case: compose(rank, world_size, case)["params"]
                for case in ("accumulate", "clip", "stages", "frozen")}
    finally:
        perparam.configure(owner_grad=previous.owner_grad)


@pytest.mark.fast
def test_owner_gradients_with_zero_stages_a_frozen_head_clip_and_accumulation_train_like_one_process():
    cases = ("accumulate", "clip", "stages", "frozen")
    want = {case: one_process(compose, case)["params"] for case in cases}
    for r in run_distributed(_composed, 3):
        for case in cases:
            assert max_diff(r[case], want[case]) <= 1e-5, (case, max_diff(r[case], want[case]))


def _other_routes(rank: int, world_size: int) -> dict:
    """Under each ``owner_grad`` setting, 3 steps of: an expert Linear on its own 2-rank mesh beside a dense
    one on the 4 ranks (Muon); TinyNet with qgZ ("bf16", "int8") on its owner matrices at stage 2; TinyNet
    under ``InvariantUnits`` (the invariant reduction, never to owners)."""
    from torch.distributed.device_mesh import init_device_mesh

    out: dict = {}
    for setting in ("rows", "owner"):
        previous = perparam.configure(owner_grad=setting)
        try:
            torch.manual_seed(0)
            edp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "edp"))["edp"]
            model = nn.Sequential(nn.Linear(6, 5, bias=False), nn.Linear(5, 7, bias=False))
            perparam.fully_shard(model, param_policy={"0.weight": OWNER,
                                                      "1.weight": ParamPolicy(update="owner", mesh=edp)})
            opts = [torch.optim.Muon(model.parameters(), lr=0.02)]
            for step in range(3):
                x = torch.randn(2, 6, generator=torch.Generator().manual_seed(rank + 10 * step))
                model(x).pow(2).sum().backward()
                opts[0].step()
                opts[0].zero_grad()
            out[setting, "expert"] = full_params(model)
            for quant in ("bf16", "int8"):
                policy = ParamPolicy(update="owner", grad_quant=quant, zero_stage=2)
                model, opts = recipe(rank, world_size,
                                     lambda n, p, policy=policy: hidden_owner(n, p) and policy)
                for idx, y in make_batches(3, 12):
                    F.mse_loss(model(*_share(rank, world_size, idx, y)[:1]),
                               _share(rank, world_size, idx, y)[1]).backward()
                    for opt in opts:
                        opt.step()
                        opt.zero_grad()
                out[setting, quant] = full_params(model)
            model = TinyNet(d=6)
            for block in model.blocks:
                perparam.fully_shard(block, param_policy=hidden_owner)
            perparam.fully_shard(model, param_policy=hidden_owner)
            hidden = [p for n, p in model.named_parameters()
                      if n.endswith("fc1.weight") or n.endswith("fc2.weight")]
            rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
            opts = [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=0.01)]
            inv = perparam.InvariantUnits(model, units=4, seed=7)
            for step, (x, y) in enumerate(make_batches(3, 16)):
                for u, (xu, yu) in inv.split((x, y)):
                    with inv.unit(u, step):
                        F.mse_loss(model(xu), yu).backward()
                inv.reduce()
                for opt in opts:
                    opt.step()
                    opt.zero_grad()
            out[setting, "invariant"] = full_params(model)
        finally:
            perparam.configure(owner_grad=previous.owner_grad)
    return out


def test_experts_on_their_own_mesh_qgz_and_invariant_units_give_the_default_routes_result():
    for r in run_distributed(_other_routes, 4):
        for case in ("expert", "bf16", "int8", "invariant"):
            assert max_diff(r["owner", case], r["rows", case]) == 0.0, case
