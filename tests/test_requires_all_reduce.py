"""HSDP gradient accumulation with reduce-scatter only (``set_requires_all_reduce``, FSDP2's name): every
micro-batch reduce-scatters over the shard axis, the all-reduce over the replicate axis runs once, at the
last micro-batch, for all of them; the result matches one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate

import perparam
from perparam import CommCounter, ParamPolicy
from tests.distributed import one_process, run_distributed

pytestmark = pytest.mark.fast

STEPS, MICRO_BATCHES, GLOBAL_MICRO_BATCH = 3, 3, 8


def _model() -> nn.Module:
    """Linear(4, 3) (uneven on 2 shard ranks), a replicated LayerNorm, Linear(3, 1) (rank 1: empty shard)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Tanh(), nn.Linear(3, 1))


def _batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    return [(torch.randn(GLOBAL_MICRO_BATCH, 4, generator=g), torch.randn(GLOBAL_MICRO_BATCH, 1, generator=g))
            for _ in range(MICRO_BATCHES)]


def accumulate(rank: int, world_size: int, optimizer: str) -> dict:
    model = _model()
    if world_size:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
        perparam.fully_shard(model, mesh=mesh, param_policy={"1.*": ParamPolicy(placement=Replicate())})
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-2) if optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=0.1))
    per_micro_batch = []
    n = GLOBAL_MICRO_BATCH // max(world_size, 1)
    for step in range(STEPS):
        for i, (x, y) in enumerate(_batches(step)):
            if world_size:
                model.set_requires_all_reduce(i == MICRO_BATCHES - 1)
                x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
            with CommCounter() as comm:
                (F.mse_loss(model(x), y) / MICRO_BATCHES).backward()
            per_micro_batch.append((comm.count("reduce_scatter"), comm.count("all_reduce")))
        opt.step()
        opt.zero_grad()
    full = {n: (p.full_tensor() if world_size else p).detach().clone() for n, p in model.named_parameters()}
    refusal = None
    if world_size:
        try:
            model.set_requires_all_reduce(0)
        except TypeError as e:
            refusal = str(e)
    return {"params": full, "comm": per_micro_batch, "refusal": refusal}


def accumulate_both(rank: int, world_size: int) -> dict:
    return {opt: accumulate(rank, world_size, opt) for opt in ("adamw", "sgd")}


def test_hsdp_accumulation_without_all_reduce_matches_one_process_with_one_all_reduce_per_step():
    results = run_distributed(accumulate_both, 4)
    for opt in ("adamw", "sgd"):
        want = one_process(accumulate, opt)["params"]
        for r in results:
            for name, got in r[opt]["params"].items():
                torch.testing.assert_close(got, want[name], rtol=0, atol=1e-5, msg=f"{opt} {name}")
            # per micro-batch: one reduce-scatter (sharded Linears) and one shard-axis all-reduce (the
            # replicated LayerNorm); the replicate-axis all-reduces (2: sharded and replicated) at the last
            # only
            assert r[opt]["comm"] == [(1, 1), (1, 1), (1, 3)] * STEPS
            assert r[opt]["refusal"] == "requires_all_reduce must be a bool, got 0"


def freeze_mid_accumulation(rank: int, world_size: int, frozen: str, thawed: str) -> dict:
    """SGD over 2 steps of 3 micro-batches, every micro-batch but the last held without all-reduce; after
    the first micro-batch of step 0, ``frozen`` (parameter names) are frozen (until step 1) and ``thawed``
    (frozen until then) unfrozen."""
    model = _model()
    if world_size:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
        perparam.fully_shard(model[3], mesh=mesh)
        perparam.fully_shard(model, mesh=mesh, param_policy={"1.*": ParamPolicy(placement=Replicate())})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = dict(model.named_parameters())
    named = {"frozen": [params[n] for n in frozen.split(",") if n],
             "thawed": [params[n] for n in thawed.split(",") if n]}
    for p in named["thawed"]:
        p.requires_grad_(False)
    n = GLOBAL_MICRO_BATCH // max(world_size, 1)
    for step in range(2):
        for i, (x, y) in enumerate(_batches(step)):
            if world_size:
                model.set_requires_all_reduce(i == MICRO_BATCHES - 1)
                x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
            (F.mse_loss(model(x), y) / MICRO_BATCHES).backward()
            if step == 0 and i == 0:
                for p in named["frozen"]:
                    p.requires_grad_(False)
                for p in named["thawed"]:
                    p.requires_grad_(True)
        opt.step()
        opt.zero_grad()
        for p in named["frozen"]:
            p.requires_grad_(True)
    return {n: (p.full_tensor() if world_size else p).detach().clone() for n, p in model.named_parameters()}


def test_a_parameter_frozen_or_unfrozen_between_micro_batches_held_without_all_reduce_matches_one_process():
    # a sharded weight, a replicated LayerNorm weight, a whole group (the last Linear: rank 1's shards are
    # empty); a weight and a replicated bias unfrozen after the first micro-batch, with another frozen then
    for frozen, thawed in (("0.weight", ""), ("1.weight", ""), ("3.weight,3.bias", ""),
                           ("", "0.weight,1.bias"), ("0.bias", "3.weight")):
        want = one_process(freeze_mid_accumulation, frozen, thawed)
        for r in run_distributed(freeze_mid_accumulation, 4, frozen, thawed):
            for name, got in r.items():
                torch.testing.assert_close(got, want[name], rtol=0, atol=1e-5,
                                           msg=f"{frozen}/{thawed}: {name}")
