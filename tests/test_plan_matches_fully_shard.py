"""``perparam plan`` with per-parameter policies predicts exactly the bytes a real ``fully_shard`` holds
(``perparam.memory.measure``), at K = 2 and 3, 1D and HSDP, with and without ``placement="auto"``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import perparam
from perparam.memory.measure import model_state_bytes, storage_bytes
from perparam.memory.plan import plan_module
from perparam.memory.policy_args import policy_mapping
from perparam.runtime.group import group_of
from tests.distributed import run_distributed

POLICIES = ["0.*=bf16,master=fp32", "1.*=frozen", "2.weight=frozen,int8,stored", "3.weight=nf4",
            "3.bias=replicate"]


def model() -> nn.Sequential:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 130), nn.Linear(130, 3))
    m[0].to(torch.bfloat16)  # "loaded in bf16": master_dtype keeps fp32 shards
    return m


#: stages: call-wide (``--zero-stage``) over policies that every stage takes, and a mix by tokens
STAGE_POLICIES = ["0.*=bf16,master=fp32", "1.*=frozen", "2.weight=int8", "3.weight=shard1"]
MIXED_STAGES = ["0.*=bf16,master=fp32,stage1", "1.*=frozen,stage2", "2.weight=int8,stage2", "2.bias=stage1",
                "3.weight=shard1,stage1", "3.bias=replicate"]


def measured(rank: int, world_size: int, hsdp: bool, placement: str, specs=POLICIES, zero_stage=None) -> dict:
    m = model()
    mesh = (init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp_replicate", "dp_shard")) if hsdp
            else init_device_mesh("cpu", (world_size,)))
    perparam.fully_shard(m, mesh=mesh, param_policy=policy_mapping(specs, placement, zero_stage))
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad])
    F.mse_loss(m(torch.randn(4, 5)).float(), torch.zeros(4, 3)).backward()
    opt.step()
    got = model_state_bytes(m, opt).as_dict()
    scales = [b for n, b in m.named_buffers() if n.endswith("_qscale")]
    got["params"] += storage_bytes(scales)
    got["steps"] = sum(1 for s in opt.state.values() if "step" in s)
    got["shard_rank"] = mesh.get_coordinate()[-1]
    got["slot_bytes"] = group_of(m).own.layout.slot_bytes  # what this rank sends in the group's all-gather
    return got


@pytest.mark.parametrize("world,hsdp,placement", [(2, False, "shard0"), (3, False, "shard0"),
                                                  (4, True, "shard0"), (3, False, "auto")])
def test_plan_with_per_parameter_policies_equals_the_measured_shards(world, hsdp, placement):
    shards = world // 2 if hsdp else world
    with torch.device("meta"):
        meta = model()
    plan = plan_module(meta, shards, dtype=None, optim_bytes=8,
                       param_policy=policy_mapping(POLICIES, placement))
    for got in run_distributed(measured, world, hsdp, placement):
        want = plan.rank(got["shard_rank"])
        assert got["params"] == want.params, (got, want)
        assert got["slot_bytes"] == plan.padded_param_bytes_per_rank  # wire pieces; replicated send nothing
        # AdamW: exp_avg and exp_avg_sq in the stored dtype (8 bytes per fp32 element), plus a 4-byte step
        assert got["optimizer"] == want.optimizer + 4 * got["steps"], (got, want)
        # gradients: the reduce-scatter output holds each shard padded to the chunk, plus 4-byte used flags
        assert got["grads"] >= want.grads


def measured_cases(rank: int, world_size: int, hsdp: bool, cases: list) -> list[dict]:
    return [measured(rank, world_size, hsdp, "shard0", specs, stage) for specs, stage in cases]


@pytest.mark.parametrize("world,hsdp", [(2, False), (3, False), (4, True)])
def test_plan_of_zero_stages_equals_the_measured_state(world, hsdp):
    """Stage 1/2 keep the padded unsharded copy (P row) and stage 1 the whole gradient (G row) on every
    rank: ``perparam plan`` counts them as a live call holds them, for every stage and a mix."""
    shards = world // 2 if hsdp else world
    cases = [(STAGE_POLICIES, stage) for stage in (1, 2, 3)] + [(MIXED_STAGES, None)]
    with torch.device("meta"):
        meta = model()
    plans = [plan_module(meta, shards, dtype=None, optim_bytes=8,
                         param_policy=policy_mapping(specs, "shard0", stage))
             for specs, stage in cases]
    for per_case in run_distributed(measured_cases, world, hsdp, cases):
        for plan, (_, stage), got in zip(plans, cases, per_case):
            want = plan.rank(got["shard_rank"])
            assert got["params"] == want.params, (stage, got, want)
            assert got["optimizer"] == want.optimizer + 4 * got["steps"], (stage, got, want)
            if stage == 1:  # whole gradients of their own, exactly
                assert got["grads"] == want.grads, (stage, got, want)
            else:  # reduce-scatter outputs: padded, plus used flags
                assert got["grads"] >= want.grads, (stage, got, want)
    stage1, stage2, stage3 = (p.rank(0) for p in plans[:3])
    assert stage1.params == stage2.params > stage3.params and stage1.grads > stage2.grads == stage3.grads
    assert stage1.optimizer == stage2.optimizer == stage3.optimizer


def test_plan_dp_replicate_gives_the_bytes_of_its_shard_axis_and_reports_imbalance(capsys):
    import json

    from perparam.cli import main

    assert main(["plan", "--preset", "gpt2-xl", "--world", "1024", "--dp-replicate", "16", "--json"]) == 0
    hsdp = json.loads(capsys.readouterr().out)
    assert main(["plan", "--preset", "gpt2-xl", "--world", "64", "--json"]) == 0
    flat = json.loads(capsys.readouterr().out)
    assert hsdp["imbalance"] == flat["imbalance"] and hsdp["imbalance"]["max_over_mean"] < 1e-4
    assert main(["plan", "--preset", "gpt2-xl", "--world", "1024", "--json"]) == 0
    assert abs(json.loads(capsys.readouterr().out)["imbalance"]["max_over_mean"] - 0.1652) < 1e-3
    assert main(["plan", "--world", "10", "--dp-replicate", "3"]) == 2
