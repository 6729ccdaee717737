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

POLICIES = ["0.*=bf16,master=fp32", "1.*=frozen", "2.weight=frozen,int8,stored", "3.weight=nf4", "3.bias=replicate"]


def model() -> nn.Sequential:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 130), nn.Linear(130, 3))
    m[0].to(torch.bfloat16)  # "loaded in bf16": master_dtype keeps fp32 shards
    return m


def measured(rank: int, world_size: int, hsdp: bool, placement: str) -> dict:
    m = model()
    mesh = (init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp_replicate", "dp_shard")) if hsdp
            else init_device_mesh("cpu", (world_size,)))
    perparam.fully_shard(m, mesh=mesh, param_policy=policy_mapping(POLICIES, placement))
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad])
    F.mse_loss(m(torch.randn(4, 5)).float(), torch.zeros(4, 3)).backward()
    opt.step()
    got = model_state_bytes(m, opt).as_dict()
    scales = [b for n, b in m.named_buffers() if n.endswith("_qscale")]
    got["params"] += storage_bytes(scales)
    got["steps"] = sum(1 for s in opt.state.values() if "step" in s)
    got["shard_rank"] = mesh.get_coordinate()[-1]
    got["slot_bytes"] = group_of(m).layout.slot_bytes  # what this rank sends in the group's all-gather
    return got


@pytest.mark.parametrize("world,hsdp,placement", [(2, False, "shard0"), (3, False, "shard0"), (4, True, "shard0"),
                                                  (3, False, "auto")])
def test_plan_with_per_parameter_policies_equals_the_measured_shards(world, hsdp, placement):
    shards = world // 2 if hsdp else world
    with torch.device("meta"):
        meta = model()
    plan = plan_module(meta, shards, dtype=None, optim_bytes=8, param_policy=policy_mapping(POLICIES, placement))
    for got in run_distributed(measured, world, hsdp, placement):
        want = plan.rank(got["shard_rank"])
        assert got["params"] == want.params, (got, want)
        assert got["slot_bytes"] == plan.padded_param_bytes_per_rank  # wire pieces; replicated send nothing
        # AdamW: exp_avg and exp_avg_sq in the stored dtype (8 bytes per fp32 element), plus a 4-byte step
        assert got["optimizer"] == want.optimizer + 4 * got["steps"], (got, want)
        # gradients: the reduce-scatter output holds each shard padded to the chunk, plus 4-byte used flags
        assert got["grads"] >= want.grads


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
