"""``perparam plan --tp T`` and ``--param-policy-factory``: the plan's bytes per rank equal what a real
``fully_shard`` on a dp x tp mesh holds (each rank simulated in one process through torch's fake process
group), for the GPT-2 preset's Megatron plan, with and without per-parameter policies."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore

import perparam
from perparam import ParamPolicy, QuantPolicy
from perparam.cli import main
from perparam.memory.measure import storage_bytes
from perparam.memory.plan import plan_model
from perparam.memory.presets import gpt2_tiny
from perparam.memory.tp_plan import gpt2_tp_plan

DP, TP = 2, 2


def policy() -> dict:
    """Used by the test and as ``--param-policy-factory tests.test_plan_tp:policy``."""
    return {"blocks.*.mlp.c_fc.weight": ParamPolicy(quant=QuantPolicy("int8")),
            "blocks.*.ln_*": ParamPolicy(placement="auto"),  # tiny: replicated
            "blocks.1.mlp.c_proj.weight": ParamPolicy(placement="auto"),  # tp-split: stays Shard(0)
            "wpe.weight": ParamPolicy(placement="auto")}


def measured_by_coordinate(param_policy, dp: int = DP, tp: int = TP) -> dict[tuple[int, int], int]:
    """Parameter bytes each (dp shard rank, tp rank) holds after parallelize_module + fully_shard."""
    out: dict[tuple[int, int], int] = {}
    for rank in range(dp * tp):
        dist.init_process_group("fake", rank=rank, world_size=dp * tp, store=FakeStore())
        try:
            mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp_shard", "tp"))
            torch.manual_seed(0)
            model = gpt2_tiny()
            parallelize_module(model, mesh["tp"], gpt2_tp_plan())
            perparam.fully_shard(model, mesh=mesh["dp_shard"], param_policy=param_policy)
            assert isinstance(model.blocks[0].attn.c_attn.weight, DTensor)
            attn = model.blocks[0].attn
            assert attn.c_attn.weight.placements[1:] == (Shard(0),)  # (dp_shard, tp): column-parallel
            assert attn.c_proj.weight.placements[1:] == (Shard(1),)  # row-parallel ...
            assert attn.c_proj.bias.placements == (Shard(0), Replicate())  # ... its bias replicated on tp
            out[tuple(mesh.get_coordinate())] = storage_bytes(model.parameters())
        finally:
            dist.destroy_process_group()
    return out


def measured(param_policy) -> dict[int, int]:
    """Parameter bytes each dp shard rank holds (every tp split of gpt2-tiny divides by TP = 2)."""
    out: dict[int, set] = {}
    for (d, _), value in measured_by_coordinate(param_policy).items():
        out.setdefault(d, set()).add(value)
    assert all(len(v) == 1 for v in out.values())  # the tp ranks of one dp rank hold the same bytes
    return {r: v.pop() for r, v in out.items()}


@pytest.mark.parametrize("with_policy", [False, True])
def test_plan_tp_bytes_per_rank_equal_fully_shard_on_a_dp_x_tp_mesh(with_policy):
    param_policy = policy() if with_policy else None
    got = measured(param_policy)
    plan = plan_model("gpt2-tiny", DP, dtype=None, tp=TP, param_policy=param_policy)
    flat = plan_model("gpt2-tiny", DP, dtype=None, param_policy=param_policy)
    for r in range(DP):
        assert got[r] == plan.rank(r).params, (r, got, plan.rank(r))
    assert plan.rank(0).params < flat.rank(0).params  # tp holds less per rank


def test_cli_plan_tp_and_param_policy_factory(capsys):
    args = ["plan", "--preset", "gpt2-tiny", "--dtype", "model", "--json"]
    assert main([*args, "--world", str(DP * TP), "--tp", str(TP),
                 "--param-policy-factory", "tests.test_plan_tp:policy"]) == 0
    data = json.loads(capsys.readouterr().out)
    want = plan_model("gpt2-tiny", DP, dtype=None, tp=TP, param_policy=policy())
    assert (data["tp"], data["world_size"]) == (TP, DP)
    assert data["rank"]["params_bytes"] == want.rank(0).params
    # --param-policy flags add patterns after the factory's
    assert main([*args, "--world", "2", "--param-policy-factory", "tests.test_plan_tp:policy",
                 "--param-policy", "lm_head.weight=frozen"]) == 0
    assert (json.loads(capsys.readouterr().out)["trainable_params"]
            < plan_model("gpt2-tiny", 2).trainable_params)


@pytest.mark.parametrize("dp", [2, 4])
def test_plan_tp_bytes_per_tp_rank_equal_fully_shard_when_a_split_dim_does_not_divide_by_tp(dp):
    # tp = 3 over width 64: the MLP's 256 rows and 64 columns split as torch.chunk splits them, 86/86/84 and
    # 22/22/20 (before: refused,
    # "dim 1 has size 64, which does not divide over the tp axis of size 3"; fully_shard refused it too)
    got = measured_by_coordinate(None, dp=dp, tp=3)
    for t in range(3):
        plan = plan_model("gpt2-tiny", dp, dtype=None, tp=3, tp_rank=t)
        for d in range(dp):
            assert got[(d, t)] == plan.rank(d).params, (d, t, got, plan.rank(d))
    assert got[(0, 0)] == got[(0, 1)] > got[(0, 2)]  # torch.chunk: the first tp ranks hold the larger chunks
    # the default: the most
    assert plan_model("gpt2-tiny", dp, dtype=None, tp=3).rank(0).params == got[(0, 0)]
    with pytest.raises(ValueError, match="tp_rank must be in"):
        plan_model("gpt2-tiny", 2, dtype=None, tp=3, tp_rank=3)


def test_cli_plan_tp_that_does_not_divide_a_split_dim_plans_tp_rank_0(capsys):
    assert main(["plan", "--preset", "gpt2-tiny", "--dtype", "model", "--json", "--world", "6", "--tp",
                 "3"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["rank"]["params_bytes"] == plan_model("gpt2-tiny", 2, dtype=None, tp=3).rank(0).params


@pytest.mark.parametrize("argv,words", [
    (["--tp", "4", "--world", "6"], ["--tp", "divisor"]),
    (["--param-policy-factory", "tests.test_plan_tp:nothing"], ["--param-policy-factory", "no attribute"]),
    (["--param-policy-factory", "tests.test_plan_tp"], ["--param-policy-factory", "package.module:function"]),
    (["--param-policy-factory", "tests.test_plan_tp:DP"], ["not callable"]),
    (["--param-policy-factory", "tests.test_plan_tp:measured_world"], ["returned int"]),
])
def test_cli_plan_tp_and_factory_errors_are_one_line(argv, words, capsys):
    assert main(["plan", "--preset", "gpt2-tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(w in err for w in words), err


def measured_world() -> int:
    return 4


def _fully_shard_refusal(param_policy) -> str:
    """The error ``fully_shard`` raises on rank 0 of a dp x tp mesh (fake process group) for
    ``param_policy``."""
    dist.init_process_group("fake", rank=0, world_size=DP * TP, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp_shard", "tp"))
        model = gpt2_tiny()
        parallelize_module(model, mesh["tp"], gpt2_tp_plan())
        with pytest.raises(perparam.ShardingError) as e:
            perparam.fully_shard(model, mesh=mesh["dp_shard"], param_policy=param_policy)
        return str(e.value)
    finally:
        dist.destroy_process_group()


# split; replicated
@pytest.mark.parametrize("name", ["blocks.0.mlp.c_fc.weight", "blocks.1.attn.c_proj.bias"])
def test_plan_tp_refuses_an_owner_update_on_a_tensor_parallel_parameter_as_fully_shard_does(name, capsys):
    # before: the planner printed an owner plan (exit 0) for what fully_shard refuses
    runtime = _fully_shard_refusal({name: ParamPolicy(update="owner")})
    assert f"'{name}'" in runtime and "tensor-parallel" in runtime and "update='owner'" in runtime, runtime
    with pytest.raises(ValueError) as e:
        plan_model("gpt2-tiny", DP, dtype=None, tp=TP, param_policy={name: ParamPolicy(update="owner")})
    assert str(e.value) in runtime  # one check, one message (fully_shard's names its module too)
    assert main(["plan", "--preset", "gpt2-tiny", "--world", str(DP * TP), "--tp", str(TP),
                 "--param-policy", f"{name}=owner"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(e.value) in err, err
    # the same matrix without tp is planned with an owner
    assert plan_model("gpt2-tiny", DP, dtype=None,
                      param_policy={name: ParamPolicy(update="owner")}).owner_params
