"""The gradient divide factor: a group's reduced gradient is the sum over its mesh's ranks divided by the
factor (default: the mesh's size). Mixture of experts with the experts on their own 1-rank mesh (EP = 2 on
2 ranks, tokens routed with a differentiable all-to-all) matches one process only with the factor set to
the 2 ranks whose losses are averaged; without it every expert gradient is EP = 2 times too large. HSDP
(2 x 2) and ``Replicate()`` parameters divide by the factor too; a factor equal to the mesh's size is the
default bitwise (bf16 reductions included); bad factors are refused."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

import perparam
from perparam import CommCounter, MixedPrecisionPolicy, ParamPolicy
from tests import moe_helpers as moe
from tests.distributed import run_distributed

D = moe.D


def expert_parallel(rank: int, world_size: int, optimizer: str, factor: float | None) -> dict:
    """EP = 2: dense ``pre``/``post`` sharded on the 2-rank mesh, rank r's expert on its own 1-rank
    expert-data-parallel mesh with ``gradient_divide_factor=factor``. Returns the first step's gradients,
    the parameters after ``STEPS`` steps (the expert under its reference name ``experts.<rank>``) and the
    collectives (kind, group size) of the second step."""
    model = moe.expert_parallel_model(rank)
    edp = init_device_mesh("cpu", (2, 1), mesh_dim_names=("ep", "edp"))["edp"]
    perparam.fully_shard(model.expert, mesh=edp, gradient_divide_factor=factor)
    perparam.fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    out = moe.train(model, moe.make_optimizer(model.parameters(), optimizer), rank, rank)
    return {**out, "counts": out["counts"][1]}


@pytest.mark.fast
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_expert_gradients_match_one_process_with_divide_factor(optimizer):
    want = moe.reference(optimizer)
    for got in run_distributed(expert_parallel, 2, optimizer, 2):
        moe.assert_matches(got["grads"], want["grads"])
        moe.assert_matches(got["params"], want["params"])


def test_without_a_factor_expert_gradients_are_ep_times_the_mean():
    want = moe.reference("sgd")["grads"]
    for got in run_distributed(expert_parallel, 2, "sgd", None):
        for name, value in got["grads"].items():
            scale = 2 if name.startswith("experts.") else 1  # divided by the expert mesh's size, 1
            torch.testing.assert_close(value, scale * want[name], atol=moe.TOL, rtol=0, msg=name)


def test_the_factor_adds_no_collective():
    # per step: forward gathers the dense group (2 ranks) and the expert (1 rank); the expert gathers again
    # in backward (the root keeps its parameters); one reduce-scatter each. The factor is only a division.
    want = Counter({("all_gather", 2): 1, ("all_gather", 1): 2, ("reduce_scatter", 2): 1,
                    ("reduce_scatter", 1): 1})
    for factor in (None, 2):
        for got in run_distributed(expert_parallel, 2, "sgd", factor):
            assert got["counts"] == want, factor


# -- HSDP, Replicate() parameters, low-precision reductions ------------------------------------------------
HSDP_CASES = {"fp32": (torch.float32, None), "fp32_factor_2": (torch.float32, 2),
              "bf16": (torch.bfloat16, None), "bf16_factor_4": (torch.bfloat16, 4.0)}


def _small() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, 2))


def _hsdp_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(8, D, generator=g), torch.randn(8, 2, generator=g)


def hsdp_grads(rank: int, world_size: int) -> dict:
    """A 2 x 2 (replicate, shard) mesh, biases ``Replicate()``; one backward per case of ``HSDP_CASES``.
    Returns each case's gradients (full, fp32) and collectives."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    x, y = (t[2 * rank:2 * rank + 2] for t in _hsdp_batch())
    out = {}
    for case, (reduce_dtype, factor) in HSDP_CASES.items():
        model = _small()
        perparam.fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=reduce_dtype),
                             param_policy={"*.bias": ParamPolicy(placement=Replicate())},
                             gradient_divide_factor=factor)
        with CommCounter() as comm:
            F.mse_loss(model(x), y).backward()
        placements = {n: p.placements[-1] for n, p in model.named_parameters()}
        out[case] = {"grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()},
                     "counts": Counter((r.kind, r.group_size) for r in comm.records),
                     "placements": placements}
    return out


def test_hsdp_and_replicated_gradients_are_divided_by_the_factor_and_the_default_is_the_mesh_size_bitwise():
    model = _small()
    x, y = _hsdp_batch()
    F.mse_loss(model(x), y).backward()  # the mean over 4 ranks' equal batches
    want = {n: p.grad for n, p in model.named_parameters()}
    for got in run_distributed(hsdp_grads, 4):
        assert (got["fp32"]["placements"]["0.bias"] == Replicate()
                and got["fp32"]["placements"]["0.weight"] != Replicate())
        moe.assert_matches(got["fp32"]["grads"], want)
        # the sum over 4 ranks divided by 2: twice the mean, sharded and replicated parameters alike
        moe.assert_matches(got["fp32_factor_2"]["grads"], {n: 2 * g for n, g in want.items()})
        # a factor equal to the mesh's size is the default, bitwise, in a bf16 reduction too
        for name, value in got["bf16"]["grads"].items():
            assert torch.equal(got["bf16_factor_4"]["grads"][name], value), name
        assert all(c["counts"] == got["fp32"]["counts"] for c in got.values())  # the same collectives


# -- errors -------------------------------------------------------------------------------------------------
BAD_FACTORS = [0, -2.0, float("nan"), float("inf"), True, "2"]


def bad_factors(rank: int, world_size: int, via_setter: bool) -> list[str]:
    messages = []
    for factor in BAD_FACTORS:
        model = nn.Linear(D, 2)
        try:
            if via_setter:
                perparam.fully_shard(model)
                model.set_gradient_divide_factor(factor)
            else:
                perparam.fully_shard(model, gradient_divide_factor=factor)
            messages.append("no error")
        except perparam.ShardingError as e:
            messages.append(str(e))
    return messages


@pytest.mark.parametrize("via_setter", [False, True], ids=["fully_shard", "set_gradient_divide_factor"])
def test_a_factor_that_is_not_a_positive_finite_number_is_refused(via_setter):
    (messages,) = run_distributed(bad_factors, 1, via_setter)
    for factor, message in zip(BAD_FACTORS, messages):
        assert repr(factor) in message and "positive finite number" in message, message
        assert "data-parallel degree" in message, message
        assert ("Linear.set_gradient_divide_factor" if via_setter
                else "fully_shard(gradient_divide_factor") in message


def setter_scope(rank: int, world_size: int, recurse: bool) -> dict:
    model = nn.Sequential(nn.Linear(D, D), nn.Linear(D, 2))
    perparam.fully_shard(model[0])
    perparam.fully_shard(model)
    model.set_gradient_divide_factor(4, recurse=recurse)
    model(torch.ones(2, D)).sum().backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    model.set_gradient_divide_factor(None, recurse=True)  # back to the mesh's size
    model.zero_grad()
    model(torch.ones(2, D)).sum().backward()
    return {"scaled": grads, "default": {n: p.grad.full_tensor() for n, p in model.named_parameters()},
            "dtensor": all(isinstance(p.grad, DTensor) for p in model.parameters())}


@pytest.mark.parametrize("recurse", [False, True])
def test_set_gradient_divide_factor_sets_this_module_or_with_recurse_every_module_below(recurse):
    for got in run_distributed(setter_scope, 2, recurse):
        assert got["dtensor"]
        for name, value in got["default"].items():
            scale = 0.5 if recurse or name.startswith("1.") else 1  # the sum over 2 ranks / 4, not / 2
            torch.testing.assert_close(got["scaled"][name], scale * value, atol=1e-6, rtol=0, msg=name)
