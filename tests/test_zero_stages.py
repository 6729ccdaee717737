"""ZeRO-1, -2 and -3 as a per-parameter choice (``ParamPolicy(zero_stage=...)``): parity with one process
(1D K = 1-4 with uneven and empty shards, HSDP 2x2, dp=2 x tp=2), the collectives of a step per stage,
and what stays whole on each rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import perparam
from perparam import CommCounter, ParamPolicy
from tests.distributed import one_process, run_distributed
from tests.models import MLPNet, TinyNet, local_slice, make_batches

STEPS, GLOBAL_BATCH, TOL = 3, 12, 1e-5

#: the mix: each stage, on Shard(0) and Shard(1), stage-1/2 parameters next to stage-3 ones in one group
_MIX = {"embed.weight": ParamPolicy(zero_stage=1), "head.weight": ParamPolicy(zero_stage=2),
        "head.bias": ParamPolicy(zero_stage=1), "norm.weight": ParamPolicy(zero_stage=1),
        "fc1.weight": ParamPolicy(zero_stage=2, placement=Shard(1)), "fc2.weight": ParamPolicy(zero_stage=1,
                                                                                               placement=Shard(1)),
        "fc2.bias": ParamPolicy(zero_stage=2), "up.weight": ParamPolicy(zero_stage=1),
        "down.weight": ParamPolicy(zero_stage=2)}


def policy(stage) -> object:
    """A call-wide ``ParamPolicy`` for stage 1, 2 or 3; ``"mix"``: ``_MIX`` by name, stage 3 elsewhere."""
    if stage == "mix":
        return lambda name, p: _MIX.get(name)
    return ParamPolicy(zero_stage=stage)


def _mesh(shape: tuple[int, ...]):
    names = ("dp_replicate", "dp_shard")[-len(shape):]
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _optimizer(name: str, params):
    if name == "sgd":  # SGD shows a wrong scale factor that Adam's normalisation would hide
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2)


def train(rank: int, world_size: int, mesh_shape: tuple[int, ...] | None, stage, opt_name: str) -> dict:
    """``STEPS`` steps of TinyNet (blocks sharded apart, then the root) under ``stage``; ``world_size == 0``:
    one process, the whole batch."""
    torch.manual_seed(0)
    model = TinyNet()
    if world_size:
        mesh = _mesh(mesh_shape)
        for block in model.blocks:
            perparam.fully_shard(block, mesh=mesh, param_policy=policy(stage))
        perparam.fully_shard(model, mesh=mesh, param_policy=policy(stage))
    opt = _optimizer(opt_name, model.parameters())
    out: dict = {"losses": [], "grads": []}
    for x, y in make_batches(STEPS, GLOBAL_BATCH):
        if world_size:
            x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        out["grads"].append({n: _full(p.grad) for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    out["params"] = {n: _full(p) for n, p in model.named_parameters()}
    with torch.no_grad():  # the forward after the last step computes with refreshed kept copies
        x, y = make_batches(1, GLOBAL_BATCH, seed=1)[0]
        if world_size:
            x = local_slice(x, rank, world_size)
        out["after"] = _full(model(x))
    return out


def _assert_matches(got: dict, want: dict, what: str, rank: int, world_size: int) -> None:
    for step, (g, w) in enumerate(zip(got["grads"], want["grads"])):
        for n in w:
            torch.testing.assert_close(g[n], w[n], atol=TOL, rtol=0, msg=f"{what}: grad {n} at step {step}")
    for n, p in want["params"].items():
        torch.testing.assert_close(got["params"][n], p, atol=TOL, rtol=0, msg=f"{what}: param {n}")
    rows = local_slice(want["after"], rank, world_size) if world_size else want["after"]
    torch.testing.assert_close(got["after"], rows, atol=TOL, rtol=0, msg=f"{what}: forward after the steps")


@pytest.fixture(scope="module")
def reference() -> dict:
    return {opt: one_process(train, None, None, opt) for opt in ("adamw", "sgd")}


@pytest.mark.parametrize(("stage", "world_size"), [(1, 3), (2, 3), (3, 3), ("mix", 1), ("mix", 2), ("mix", 3),
                                                   ("mix", 4)])
def test_each_stage_and_a_mix_match_one_process_on_uneven_and_empty_shards(reference, stage, world_size):
    for opt in ("adamw", "sgd"):
        results = run_distributed(train, world_size, (world_size,), stage, opt)
        for rank, got in enumerate(results):
            _assert_matches(got, reference[opt], f"stage {stage} K={world_size} {opt} rank {rank}", rank,
                            world_size)


@pytest.mark.parametrize("stage", [1, 2, "mix"])
def test_stages_on_hsdp_2x2_match_one_process(reference, stage):
    results = run_distributed(train, 4, (2, 2), stage, "adamw")
    for rank, got in enumerate(results):
        _assert_matches(got, reference["adamw"], f"stage {stage} HSDP 2x2 rank {rank}", rank, 4)
