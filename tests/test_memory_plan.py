"""``perparam plan``: per-rank bytes of a meta-device model's per-parameter layout, against the formulas."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import perparam
from perparam.cli import main
from perparam.memory.formulas import GB, stage_memory
from perparam.memory.plan import build_on_meta, plan_model, plan_module
from perparam.memory.presets import GPT2_CONFIGS, PRESETS, gpt2_tiny
from perparam.sharding.layout import ShardLayout

GPT2_XL_PARAMS = 1_557_611_200
BUILT_ON: list[torch.device] = []


def tiny_factory() -> nn.Module:
    """A factory for ``--model``: two linears and a frozen buffer-like parameter; records its device."""
    model = nn.Sequential(nn.Linear(10, 7), nn.ReLU(), nn.Linear(7, 3, bias=False))
    model.register_parameter("frozen", nn.Parameter(torch.empty(5, 2), requires_grad=False))
    BUILT_ON.append(model[0].weight.device)
    return model


@pytest.fixture(scope="module")
def xl64():
    return plan_model("gpt2-xl", 64)


def test_gpt2_xl_shape_and_count(xl64):
    assert GPT2_CONFIGS["gpt2-xl"].num_params() == GPT2_XL_PARAMS
    assert xl64.num_params == xl64.trainable_params == GPT2_XL_PARAMS
    names = [p.name for p in xl64.params]
    assert "wte.weight" in names and "lm_head.weight" not in names  # tied: counted once
    assert len(names) == 4 + 48 * 12
    shapes = {p.name: p.layout.global_shape for p in xl64.params}
    assert shapes["wte.weight"] == (50257, 1600) and shapes["blocks.0.mlp.c_fc.weight"] == (6400, 1600)


@pytest.mark.parametrize("name", ["gpt2", "gpt2-medium", "gpt2-tiny"])
def test_closed_form_count_matches_module(name):
    assert plan_model(name, 4).num_params == GPT2_CONFIGS[name].num_params()


def test_gpt2_xl_k64_matches_zero3_formula(xl64):
    formula = stage_memory("ZeRO-3", GPT2_XL_PARAMS, 64)
    assert formula.total == Fraction(16 * GPT2_XL_PARAMS, 64)
    assert xl64.formula("ZeRO-3") == formula
    mx = xl64.max_rank
    assert mx.rank == 0 and mx == xl64.rank(0)
    assert abs(Fraction(mx.total) / formula.total - 1) < Fraction(1, 100)
    assert abs(Fraction(xl64.min_rank.total) / formula.total - 1) < Fraction(1, 100)
    # the textbook's 0.375 GB is for a nominal 1.5e9 parameters
    assert xl64.nominal_params == 1_500_000_000
    assert xl64.nominal_formula("ZeRO-3").total == Fraction(375, 1000) * GB
    assert 0.375 * GB < mx.total < 0.375 * GB * 1.04


def test_components_use_table_bytes(xl64):
    r0 = xl64.rank(0)
    assert r0.params == r0.grads and r0.optimizer == 6 * r0.params  # 2 : 2 : 12
    assert xl64.unsharded.total == 16 * GPT2_XL_PARAMS
    assert xl64.sum_over_ranks() == xl64.unsharded


def test_plan_at_k1024_covers_every_rank_and_shows_the_lopsided_chunk_layout():
    # no timing asserted here (a loaded CI machine is not a benchmark): benchmarks/ measures speed
    plan = plan_model("gpt2-xl", 1024)
    assert len(plan.per_rank) == 1024
    assert plan.max_rank.rank == 0
    assert plan.sum_over_ranks() == plan.unsharded
    assert all(b.total <= plan.rank(0).total for b in plan.per_rank)
    # K > 1024 rows of wpe: the last ranks hold nothing of it
    assert plan.rank(1023).total < plan.rank(0).total
    # ...so at this K the chunk layout is lopsided: rank 0 holds ~16.5% more than the (exact) mean
    mean = Fraction(plan.unsharded.total, 1024)
    assert Fraction(116, 100) < plan.rank(0).total / mean < Fraction(117, 100)


@pytest.mark.fast
def test_plan_matches_layout_per_parameter():
    plan = plan_model("gpt2-tiny", 5)
    model = build_on_meta(gpt2_tiny)
    for r in range(5):
        want = sum(ShardLayout(tuple(p.shape), torch.float16, 5, Shard(0)).local_bytes(r)
                   for p in model.parameters())
        assert plan.rank(r).params == want


def test_factory_runs_on_meta_and_frozen_params_have_no_state():
    BUILT_ON.clear()
    plan = plan_model(f"{__name__}:tiny_factory", 4, dtype=None)
    assert BUILT_ON == [torch.device("meta")]
    assert plan.num_params == 10 * 7 + 7 + 7 * 3 + 10
    assert plan.trainable_params == plan.num_params - 10
    u = plan.unsharded
    assert (u.params, u.grads, u.optimizer) == (4 * 108, 4 * 98, 12 * 98)  # fp32 as built
    assert plan.sum_over_ranks() == u


@pytest.mark.parametrize("policy", [{"scale": perparam.ParamPolicy(placement=Replicate())},
                                    perparam.ParamPolicy(placement="auto")])
def test_scalar_parameters_are_replicated_as_fully_shard_does(policy):
    model = nn.Module()
    model.register_parameter("scale", nn.Parameter(torch.empty((), device="meta")))
    model.register_parameter("w", nn.Parameter(torch.empty(6, 2, device="meta")))
    with pytest.raises(ValueError, match=r"'scale' is 0-dim.*ParamPolicy\(placement=Replicate\(\)\)"):
        plan_module(model, 4)  # fully_shard refuses it too (tests/test_fully_shard_errors.py)
    plan = plan_module(model, 4, param_policy=policy)
    assert [str(p.placements) for p in plan.params][0] == "(Replicate(),)"
    if isinstance(policy, dict):
        assert str(plan.params[1].placements) == "(Shard(dim=0),)"
        # w: 6 rows over 4 ranks in chunks of 2 -> 2, 2, 2, 0 rows of 2 fp16 elements; the scalar on every
        # rank
        assert [plan.rank(r).params for r in range(4)] == [2 + 8, 2 + 8, 2 + 8, 2 + 0]


# -- property: local bytes hold no padding, so the ranks add up to the unsharded model -------------------

shapes = st.lists(st.integers(0, 37), min_size=1, max_size=3).map(tuple)
dtypes = st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64])


@settings(max_examples=60, deadline=None)
@given(
    params=st.lists(st.tuples(shapes, dtypes, st.booleans()), min_size=1, max_size=8),
    k=st.integers(1, 70),
    keep_dtype=st.booleans(),
    optim=st.fractions(0, 16, max_denominator=4),
    grad=st.one_of(st.none(), st.integers(0, 4)),
)
def test_ranks_sum_to_unsharded(params, k, keep_dtype, optim, grad):
    model = nn.Module()
    for i, (shape, dtype, trainable) in enumerate(params):
        model.register_parameter(f"p{i}", nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"),
                                                       requires_grad=trainable))
    plan = plan_module(model, k, dtype=None if keep_dtype else torch.float16, grad_bytes=grad,
                       optim_bytes=optim)
    total = plan.sum_over_ranks()
    assert total == plan.unsharded
    itemsize = (lambda d: d.itemsize) if keep_dtype else (lambda d: 2)
    assert total.params == sum(torch.Size(s).numel() * itemsize(d) for s, d, _ in params)
    trainable = sum(torch.Size(s).numel() for s, _, t in params if t)
    assert total.optimizer == trainable * optim
    assert plan.max_rank.rank == 0  # torch.chunk: non-increasing piece sizes
    assert all(plan.padded_param_bytes_per_rank >= b.params for b in plan.per_rank)
    if not keep_dtype and grad is None:
        formula = plan.formula("ZeRO-3")
        assert formula.total * k == total.total


# -- CLI ----------------------------------------------------------------------------------------------

def test_cli_plan_table(capsys):
    assert main(["plan", "--preset", "gpt2-xl", "--world", "64"]) == 0
    out = capsys.readouterr().out
    assert "1,557,611,200" in out and "(Shard(0),)" in out
    assert "plan: max over ranks (rank 0)" in out
    assert "0.375000" in out and "0.389403" in out  # nominal and real-count ZeRO-3 formula
    assert "0.389422" in out  # rank 0 of the plan


def test_cli_plan_json(capsys):
    assert main(["plan", "--preset", "gpt2-xl", "--world", "64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_params"] == GPT2_XL_PARAMS and data["world_size"] == 64
    assert data["max_over_ranks"]["rank"] == 0
    assert abs(data["max_rank_vs_formula"]) < 0.01
    assert data["zero3_formula_nominal"]["total_gb_str"] == "0.375000"
    assert data["sum_over_ranks"] == data["unsharded"] | {"rank": -1}
    assert "params" not in data


def test_cli_params_table(capsys):
    assert main(["plan", "--preset", "gpt2-tiny", "--world", "3", "--params-table", "--rank", "2"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.split()[:1] == ["wte.weight"])
    # (1000, 64) over 3 ranks: chunks of 334, 334, 332 rows; fp16
    assert "(1000, 64)" in line and "(332, 64)" in line and "float16" in line and "42,496" in line

    assert main(["plan", "--preset", "gpt2-tiny", "-K", "3", "--params-table", "--rank", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    wte = data["params"][0]
    assert wte == {"name": "wte.weight", "global_shape": [1000, 64], "placements": "(Shard(0),)",
                   "local_shape": [332, 64], "dtype": "float16", "local_bytes": 332 * 64 * 2,
                   "requires_grad": True, "zero_stage": 3, "kept_bytes": 0, "shard_in_kept": False}


def test_cli_model_flag(capsys):
    assert main(["plan", "--model", f"{__name__}:tiny_factory", "--world", "2", "--json", "--dtype",
                 "model"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_params"] == 108 and data["bytes_per_element"]["params"] == ["float32"]
    assert main(["plan", "--model", "perparam.memory.presets:gpt2_tiny", "-K", "2"]) == 0
    assert "gpt2_tiny" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ["--preset", "gpt2-tiny", "--world", "0"],
    ["--preset", "gpt2-tiny", "--world", "4", "--rank", "4"],
    ["--model", "nope"],
    ["--model", "perparam.memory.presets:missing"],
    ["--model", "perparam.memory.presets:GPT2_CONFIGS.keys"],  # callable, returns no nn.Module
])
def test_cli_plan_errors(argv, capsys):
    assert main(["plan", *argv]) == 2
    assert "perparam plan:" in capsys.readouterr().err


def test_presets_forward_on_cpu():
    model = gpt2_tiny()
    logits = model(torch.randint(0, 1000, (2, 9)))
    assert logits.shape == (2, 9, 1000)
    assert model.lm_head.weight is model.wte.weight
    assert set(PRESETS) >= {"gpt2", "gpt2-xl"}


def test_plan_with_auto_placement_lowers_the_largest_rank_at_k1024():
    shard0 = plan_model("gpt2-xl", 1024)
    auto = plan_model("gpt2-xl", 1024, param_policy=perparam.ParamPolicy(placement="auto"))
    assert auto.sum_over_ranks() == auto.unsharded == shard0.unsharded
    mean = Fraction(auto.unsharded.total, 1024)
    assert auto.max_rank.total < shard0.max_rank.total
    assert Fraction(111, 100) < auto.max_rank.total / mean < Fraction(112, 100)  # 11.5% (Shard(0): 16.5%)
    assert any(p.layout.placement == Shard(1) for p in auto.params)


def test_cli_plan_placement_auto(capsys):
    assert main(["plan", "--preset", "gpt2-tiny", "-K", "3", "--placement", "auto", "--json",
                 "--params-table"]) == 0
    data = json.loads(capsys.readouterr().out)
    # tiny (<= 1024-byte) parameters are replicated: every rank holds a copy, so the ranks sum to more
    assert "(Replicate(),)" in {p["placements"] for p in data["params"]}
    assert data["sum_over_ranks"]["params_bytes"] > data["unsharded"]["params_bytes"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_plan_of_an_all_stage_k_policy_gives_table_7_2_rows_up_to_padding(stage, capsys):
    from perparam.memory.policy_args import policy_mapping

    k = 4
    plan = plan_model("gpt2-tiny", k, param_policy=policy_mapping([], zero_stage=stage))
    formula, rank = plan.formula(f"ZeRO-{stage}"), plan.rank(0)
    padding = sum(p.layout.padded_local_numel - p.layout.local_numel(0) for p in plan.params) * 2  # fp16
    # stages 1/2 keep the parameter whole, and the shard the optimizer updates is a view of it: Table 7-2's P
    assert 0 <= rank.params - formula.params <= (k + 1) * padding
    assert 0 <= rank.grads - formula.grads <= padding  # stage 1: the whole gradient, exactly G
    assert 0 <= rank.optimizer - formula.optimizer <= 6 * padding
    assert main(["plan", "--preset", "gpt2-tiny", "-K", "4", "--zero-stage", str(stage), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["zero_stages"] == [stage] and out["rank"]["total_bytes"] == rank.total


def test_plan_takes_a_stage_per_pattern_and_refuses_an_unknown_one(capsys):
    assert main(["plan", "--preset", "gpt2-tiny", "-K", "2", "--param-policy", "*.attn.*=stage1",
                 "--zero-stage", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["zero_stages"] == [1, 2]
    assert main(["plan", "--preset", "gpt2-tiny", "-K", "2", "--param-policy", "*.attn.*=stage4"]) == 2
    err = capsys.readouterr().err
    assert "zero_stage=4" in err and "use 1" in err
