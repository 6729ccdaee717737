"""Bad input gets a clear error at fully_shard time, naming the parameter or module."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import perparam
from perparam import ShardingError
from tests.distributed import run_distributed

pytestmark = pytest.mark.fast


class Scalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.0))


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4, 3)
        self.head = nn.Linear(3, 4, bias=False)
        self.head.weight = self.embed.weight


class _ClaimsGrad(nn.Parameter):
    """torch refuses requires_grad on integer tensors; a subclass (as quantized-weight libraries write)
    can still claim it, which fully_shard must refuse."""

    @property
    def requires_grad(self) -> bool:
        return True


class IntParamRequiringGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        codes = nn.Parameter(torch.zeros(4, dtype=torch.uint8), requires_grad=False)
        codes.__class__ = _ClaimsGrad
        self.codes = codes


def _case(name: str) -> None:
    if name == "zero_dim":
        perparam.fully_shard(Scalar())
    elif name == "tied_across_calls":
        model = Tied()
        perparam.fully_shard(model.embed)
        perparam.fully_shard(model)
    elif name == "twice":
        model = nn.Linear(2, 2)
        perparam.fully_shard(model)
        perparam.fully_shard(model)
    elif name == "parent_first":
        model = nn.Sequential(nn.Linear(2, 2))
        perparam.fully_shard(model)
        perparam.fully_shard(model[0])
    elif name == "mesh_3d":
        mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("a", "b", "c"))
        perparam.fully_shard(nn.Linear(2, 2), mesh=mesh)
    elif name == "not_a_mesh":
        perparam.fully_shard(nn.Linear(2, 2), mesh="cpu")
    elif name == "int_requires_grad":
        perparam.fully_shard(IntParamRequiringGrad())
    elif name == "empty_list":
        perparam.fully_shard([])
    elif name == "listed_twice":
        block = nn.Linear(2, 2)
        perparam.fully_shard([block, block])
    elif name == "mp_policy_type":
        perparam.fully_shard(nn.Linear(2, 2), mp_policy={"param_dtype": torch.bfloat16})
    elif name == "param_policy_type":
        perparam.fully_shard(nn.Linear(2, 2), param_policy=[perparam.ParamPolicy()])
    elif name == "lazy_module":
        perparam.fully_shard(nn.Sequential(nn.Linear(2, 2), nn.LazyBatchNorm1d()))
    elif name == "norm_param_dtype":  # a norm computes with its fp32 running statistics
        perparam.fully_shard(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)),
                             param_policy={"1.*": perparam.ParamPolicy(param_dtype=torch.bfloat16)})
    elif name == "dtype_as_string":
        perparam.fully_shard(nn.Linear(2, 2), mp_policy=perparam.MixedPrecisionPolicy(param_dtype="bf16"))
    else:
        raise AssertionError(name)


def raise_case(rank: int, world_size: int, name: str) -> tuple[str, str]:
    try:
        _case(name)
    except (ShardingError, NotImplementedError) as e:
        return type(e).__name__, str(e)
    return "no error", ""


CASES = {
    "zero_dim": ["'scale'", "0-dim", "ParamPolicy(placement=Replicate())"],
    "tied_across_calls": ["'head.weight'", "'weight'", "Embedding", "Tied (this call)",
                          "fully_shard([module_a, module_b])"],
    "twice": ["already applied", "Linear"],
    "parent_first": ["'weight'", "already sharded", "bottom-up"],
    "mesh_3d": ["3D mesh", "(replicate, shard)"],
    "not_a_mesh": ["DeviceMesh", "str"],
    "int_requires_grad": ["'codes'", "torch.uint8", "requires_grad=False"],
    "empty_list": ["non-empty list"],
    "listed_twice": ["same module twice"],
    "mp_policy_type": ["MixedPrecisionPolicy", "dict"],
    "param_policy_type": ["ParamPolicy", "list"],
    "dtype_as_string": ["torch.dtype", "'bf16'"],
    "lazy_module": ["'1.weight'", "Lazy", "forward with a sample batch before fully_shard"],
    "norm_param_dtype": ["'1.weight'", "running statistics", "torch.float32", "drop its param_dtype"],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_named_and_explained(name):
    kind, message = run_distributed(raise_case, 1, name)[0]
    assert kind == "ShardingError", (kind, message)
    for fragment in CASES[name]:
        assert fragment in message, (fragment, message)


def mesh_none_without_process_group(rank: int, world_size: int) -> str:
    import torch.distributed as dist

    dist.destroy_process_group()
    try:
        perparam.fully_shard(nn.Linear(2, 2))
    except ShardingError as e:
        return str(e)
    return ""


def test_mesh_none_needs_a_process_group():
    assert "init_process_group" in run_distributed(mesh_none_without_process_group, 1)[0]


def wrong_field_types(rank: int, world_size: int) -> dict[str, str]:
    """Each policy field given a value of the wrong type, in one process: case -> the error's message."""
    pp, qp = perparam.ParamPolicy, perparam.QuantPolicy
    calls = {
        "pattern_not_a_string": {"param_policy": {0: pp()}},
        "quant_as_a_string": {"param_policy": pp(quant="int8")},
        "requires_grad_as_a_string": {"param_policy": pp(requires_grad="no")},
        "store_quantized_as_a_string": {"param_policy": pp(requires_grad=False,
                                                             quant=qp("int8", store_quantized="yes"))},
        "pin_memory_as_a_string": {"offload_policy": perparam.OffloadPolicy("cpu", pin_memory="no")},
        "cast_forward_inputs_as_a_string": {
            "mp_policy": perparam.MixedPrecisionPolicy(cast_forward_inputs="no")},
    }
    out = {}
    for case, kwargs in calls.items():
        try:
            perparam.fully_shard(nn.Linear(2, 2), **kwargs)
            out[case] = "no error"
        except ShardingError as e:
            out[case] = str(e)
    return out


WRONG_TYPES = {
    "pattern_not_a_string": ["pattern 0", "glob strings", "'weight'"],
    "quant_as_a_string": ["'weight'", "ParamPolicy(quant=QuantPolicy('int8'))"],
    "requires_grad_as_a_string": ["'weight'", "True, False or None", "'no'"],
    "store_quantized_as_a_string": ["'weight'", "store_quantized", "'yes'"],
    "pin_memory_as_a_string": ["offload_policy", "pin_memory='no'", "True or False"],
    "cast_forward_inputs_as_a_string": ["cast_forward_inputs", "'no'"],
}


def test_policy_fields_of_a_wrong_type_are_named_and_explained():
    messages = run_distributed(wrong_field_types, 1)[0]
    for case, fragments in WRONG_TYPES.items():
        for fragment in fragments:
            assert fragment in messages[case], (case, fragment, messages[case])


def meta_forward_and_foreign_mesh(rank: int, world_size: int) -> dict[str, str]:
    from torch.distributed.device_mesh import DeviceMesh

    out = {}
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))  # 2 rows on 2 ranks
    perparam.fully_shard(model[0])
    perparam.fully_shard(model)
    try:
        model(torch.randn(2, 4))
        out["meta"] = "no error"
    except ShardingError as e:
        out["meta"] = str(e)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    try:
        opt.step()  # nothing to change on meta: refused rather than silently nothing
        out["meta_step"] = "no error"
    except ShardingError as e:
        out["meta_step"] = str(e)
    model.to_empty(device="cpu")
    opt.step()  # once given storage, the same optimizer steps
    mesh = DeviceMesh("cpu", [0])  # every rank builds it; rank 1 is not in it
    if rank == 1:
        try:
            perparam.fully_shard(nn.Linear(2, 2), mesh=mesh)
            out["foreign_mesh"] = "no error"
        except ShardingError as e:
            out["foreign_mesh"] = str(e)
    return out


def test_meta_model_forward_and_optimizer_step_and_a_mesh_without_this_rank_are_named_on_every_rank():
    results = run_distributed(meta_forward_and_foreign_mesh, 2)
    for out in results:  # every rank raises before any collective: no rank waits for another
        for fragment in ("'1.weight'", "of Sequential", "meta device", "to_empty", "load_full_state_dict"):
            assert fragment in out["meta"], (fragment, out["meta"])
        for fragment in ("AdamW.step()", "'0.weight'", "meta device", "to_empty", "load_full_state_dict"):
            assert fragment in out["meta_step"], (fragment, out["meta_step"])
    for fragment in ("fully_shard(Linear)", "rank (1)", "ranks [0]", "mesh=None"):
        assert fragment in results[1]["foreign_mesh"], (fragment, results[1]["foreign_mesh"])
