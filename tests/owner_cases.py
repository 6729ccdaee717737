"""Shared by the owner path's test files (``test_whole_matrix.py``, ``test_owner_grad.py``): the owner
policy, TinyNet with Muon on its blocks' hidden matrices and AdamW on the rest (``recipe``), the composition
runs (``compose``) and the largest parameter difference (``max_diff``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import perparam
from perparam import ParamPolicy
from tests.models import TinyNet, full_params, make_batches

OWNER = ParamPolicy(update="owner")


def hidden_owner(name: str, param) -> ParamPolicy | None:
    """The owner policy for the blocks' hidden matrices (names relative to each block's fully_shard call)."""
    return OWNER if name in ("fc1.weight", "fc2.weight") else None


def recipe(rank: int, world_size: int, policy=None, mesh_shape=None, muon: dict | None = None,
            freeze_head: bool = False) -> tuple[nn.Module, list]:
    """TinyNet sharded per block then at the root (``policy``: default ``hidden_owner``; ``mesh_shape``:
    an HSDP mesh), Muon (weight decay 0.1, ``muon``'s options) on the blocks' hidden matrices and AdamW
    (weight decay 0.01) on the rest that is trainable."""
    torch.manual_seed(0)
    model = TinyNet(d=6)
    if freeze_head:
        model.head.requires_grad_(False)
    policy = policy or hidden_owner
    if world_size:
        mesh = None
        if mesh_shape:
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
        for block in model.blocks:
            perparam.fully_shard(block, mesh=mesh, param_policy=policy)
        perparam.fully_shard(model, mesh=mesh, param_policy=policy)
    named = dict(model.named_parameters())
    hidden = [p for n, p in named.items() if n.startswith("blocks") and n.endswith("weight") and p.ndim == 2]
    rest = [p for p in named.values() if all(p is not h for h in hidden) and p.requires_grad]
    return model, [torch.optim.Muon(hidden, lr=0.02, weight_decay=0.1, **(muon or {})),
                   torch.optim.AdamW(rest, lr=0.01, weight_decay=0.01)]


def max_diff(got: dict, want: dict) -> float:
    return max((got[n] - want[n]).abs().max().item() for n in want)


def compose(rank: int, world_size: int, case: str) -> dict:
    """TinyNet with Muon on the blocks' hidden matrices (owner) and AdamW on the rest, 4 steps, composed
    with ``case``: "accumulate" (2 micro-batches, the first without sync), "clip" (clip_grad_norm_ to 0.5
    before the step), "stages" (fc1 at stage 1, fc2 at stage 2, the rest stage 3), "frozen" (the head
    frozen), "dtensor_adamw" (``configure(local_optimizer_step=False)``), "adamw_owner" (an owner
    parameter in AdamW). Returns the full parameters and the Newton-Schulz calls per step."""
    import torch.optim._muon as muon_module

    calls = []
    original = muon_module._zeropower_via_newtonschulz

    def counting(grad, ns_coefficients, ns_steps, eps):
        # Newton-Schulz in fp32 here: the stock bf16 iteration turns the last-bit differences of a gradient
        # summed in another order into bf16 rounding flips (0.002 after 4 clipped steps on some CPUs), which
        # would hide what this test checks, the composition; the stock step is held bitwise by
        # test_the_owner_update_is_bitwise_torch_muon_on_the_gathered_gradient.
        calls.append(1)
        a, b, c = ns_coefficients
        x = grad.float()
        tall = x.size(0) > x.size(1)
        x = (x.T if tall else x) / x.norm().clamp(min=eps)
        for _ in range(ns_steps):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        return x.T if tall else x

    muon_module._zeropower_via_newtonschulz = counting
    previous = perparam.configure(local_optimizer_step=case != "dtensor_adamw")
    try:
        def policy(name, param):
            if name not in ("fc1.weight", "fc2.weight", "embed.weight"):
                return None
            if name == "embed.weight":
                return OWNER if case == "adamw_owner" else None
            stage = {"fc1.weight": 1, "fc2.weight": 2}[name] if case == "stages" else None
            return ParamPolicy(update="owner", zero_stage=stage)

        model, opts = recipe(rank, world_size, policy, freeze_head=case == "frozen")
        per_step = []
        k = world_size or 1
        for idx, y in make_batches(4, 12):
            if world_size:
                idx, y = idx[rank * 12 // k:(rank + 1) * 12 // k], y[rank * 12 // k:(rank + 1) * 12 // k]
            chunks = 2 if case == "accumulate" else 1
            for i, (xm, ym) in enumerate(zip(idx.chunk(chunks), y.chunk(chunks))):
                if world_size and chunks > 1:
                    model.set_requires_gradient_sync(i == chunks - 1)
                (F.mse_loss(model(xm), ym) / chunks).backward()
            if case == "clip":
                params = [p for p in model.parameters() if p.grad is not None]
                (perparam.clip_grad_norm_ if world_size else torch.nn.utils.clip_grad_norm_)(params, 0.5)
            before = len(calls)
            for opt in opts:
                opt.step()
                opt.zero_grad()
            per_step.append(len(calls) - before)
        return {"params": full_params(model), "ns_calls": per_step}
    finally:
        perparam.configure(local_optimizer_step=previous.local_optimizer_step)
        muon_module._zeropower_via_newtonschulz = original
