"""The ``fully_shard`` call (``ParamGroup``) and its mesh parts (``MeshPart``) are two classes: a part holds
no setting of the call, so a part on another mesh (``ParamPolicy(mesh=...)``) reads the call's: the
offload hook runs before an all-gather of an expert mesh's shards too (its disk-tier shards are read
ahead), and a custom reduce-scatter with ``grad_quant`` parameters on an expert mesh is refused as on
the call's mesh."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import perparam
from perparam import ParamPolicy
from perparam.runtime.group import group_of
from tests.distributed import run_distributed

#: settings and bookkeeping of the call that a part must not have a copy of
CALL_ONLY = ("state", "forward_depth", "offload_hook", "all_gather_comm", "reduce_scatter_comm",
             "all_reduce_hook", "requires_all_reduce", "gradient_divide_factor", "held_unsynced", "tree",
             "islands", "driver")


class _Comm:
    """A custom reduce-scatter (never reached: the reduction is refused first)."""

    def allocate(self, size, *, dtype, device):
        raise AssertionError("allocated")

    def __call__(self, output, input, group, op, async_op=False):
        raise AssertionError("called")


def _parts(rank: int, world_size: int) -> dict:
    dp = init_device_mesh("cpu", (4,))
    edp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "edp"))["edp"]
    # every parameter on the expert mesh: the call's own mesh's part is empty, the expert part gathers
    experts = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    perparam.fully_shard(experts, mesh=dp, param_policy={"*": ParamPolicy(mesh=edp)})
    group = group_of(experts)
    calls = []
    group.offload_hook = calls.append  # called with RuntimeConfig.gather_read_ahead
    group.unshard()
    group.reshard()
    out = {"sizes": [len(part.mesh_params) for part in group.parts], "hook_calls": len(calls),
           "leaked": sorted({name for part in group.parts for name in CALL_ONLY if hasattr(part, name)})}
    # grad_quant on the expert mesh (K = 2 there; the call's mesh holds nothing), a custom reduce-scatter
    # set past the setter's check
    # (a block of a model sharded at its root too: the runtime's refusal names the model path, 0.1.weight)
    quantized = nn.Sequential(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2)))
    perparam.fully_shard(quantized[0], mesh=dp, param_policy={"*": ParamPolicy(mesh=edp, grad_quant="int8")})
    perparam.fully_shard(quantized, mesh=dp)
    try:
        quantized[0].set_custom_reduce_scatter(_Comm())
        out["setter"] = "no error"
    except perparam.ShardingError as e:
        out["setter"] = str(e)
    group_of(quantized[0]).reduce_scatter_comm = _Comm()
    try:
        quantized(torch.ones(2, 4)).sum().backward()
        out["runtime"] = "no error"
    except RuntimeError as e:
        out["runtime"] = str(e)
    return out


def test_a_mesh_part_reads_the_calls_settings_and_has_none_of_its_own():
    for out in run_distributed(_parts, 4):
        assert out["sizes"] == [0, 4] and out["leaked"] == []
        assert out["hook_calls"] == 1  # the expert part's all-gather ran the call's offload hook
        assert "'0.1.weight'" in out["setter"] and "grad_quant" in out["setter"]
        assert "custom reduce-scatter and grad_quant" in out["runtime"]
        assert "(0.0.weight, 0.0.bias, 0.1.weight, 0.1.bias)" in out["runtime"]  # by model path
