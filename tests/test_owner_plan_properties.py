"""The owner plan of whole-matrix parameters (``perparam.sharding.owners``): deterministic, every rank
computes the same one, balanced within Graham's LPT bound; ``ParamPolicy(update="owner")`` refused where
it cannot apply, naming the parameter; ``perparam plan`` reports the plan the runtime uses."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor import Replicate

from perparam import ParamPolicy
from perparam.memory.plan import plan_module
from perparam.sharding.owners import ns_cost, owner_plan, plan_shapes
from perparam.sharding.policy import MixedPrecisionPolicy, PolicyError, resolve

pytestmark = pytest.mark.fast

shapes = st.lists(st.tuples(st.integers(0, 64), st.integers(1, 64)), min_size=0, max_size=7)


@settings(max_examples=150, deadline=None)
@given(shapes, st.integers(1, 4))
def test_the_owner_plan_is_deterministic_and_balanced_within_the_lpt_bound(shape_list, k):
    plan = plan_shapes(shape_list, k)
    assert plan == plan_shapes(list(shape_list), k)  # a pure function: every rank gets the same plan
    costs = [ns_cost(s) for s in shape_list]
    assert len(plan.owners) == len(costs) and all(0 <= r < k for r in plan.owners)
    loads = [sum(c for c, r in zip(costs, plan.owners) if r == rank) for rank in range(k)]
    assert list(plan.loads) == loads
    busiest = max(loads)
    assert busiest <= sum(costs) / k + max(costs, default=0)  # list scheduling's bound
    # Graham's LPT bound against the optimum (exhaustive: at most 4**7 assignments)
    best = min((max(sum(c for c, r in zip(costs, a) if r == rank) for rank in range(k))
                for a in itertools.product(range(k), repeat=len(costs))), default=0)
    assert busiest * 3 * k <= (4 * k - 1) * best


def test_the_owner_plan_puts_the_largest_matrix_first_onto_the_least_loaded_rank():
    # 5 -> 0, 3 -> 1, 3 -> 1 (3 < 5), 1 -> 0 (5 < 6)
    assert owner_plan([1, 5, 3, 3], 2).owners == (0, 0, 1, 1)
    assert ns_cost((13, 6), ns_steps=5) == 5 * 13 * 6 * 6
    # owners kept (they hold state) and the rest filled in by LPT onto the loads they leave
    assert owner_plan([5, 3, 1], 2, fixed={1: 0, 2: 0}).owners == (1, 0, 0)
    with pytest.raises(ValueError, match="fixed owners must be ranks"):
        owner_plan([1], 2, fixed={0: 2})
    with pytest.raises(ValueError, match="num_ranks must be >= 1"):
        owner_plan([1], 0)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([((8, 4), (4, 8), (32, 2), (2, 32)), ((16, 2), (2, 16))]).flatmap(
    lambda twins: st.lists(st.sampled_from(twins), min_size=1, max_size=12)), st.integers(1, 4))
def test_matrices_of_equal_cost_are_dealt_round_the_ranks_shape_by_shape(shape_list, k):
    # shapes of equal cost (8 x 4, 4 x 8, 32 x 2 and 2 x 32; 16 x 2 and 2 x 16), but a tall matrix is
    # transposed before its products: each shape's matrices are spread over the ranks within one of each other
    assert len({ns_cost(s) for s in shape_list}) == 1
    plan = plan_shapes(shape_list, k)
    for shape in set(shape_list):
        per_rank = [sum(1 for s, r in zip(shape_list, plan.owners) if s == shape and r == rank)
                    for rank in range(k)]
        assert max(per_rank) - min(per_rank) <= 1, (shape, per_rank)


def test_the_benchmark_gpts_tall_and_wide_twins_are_split_evenly():
    # the 27.4M GPT's Muon matrices in the optimizer's order: dealt in list order all 2048 x 512 went to
    # rank 0 and all 512 x 2048 to rank 1 (measured busiest / mean 1.082 for a planned 1.000)
    blocks = [(1536, 512), (512, 512), (2048, 512), (512, 2048)] * 6
    owners = plan_shapes(blocks, 2).owners
    for shape in set(blocks):
        assert [sum(1 for s, r in zip(blocks, owners) if s == shape and r == rank)
                for rank in (0, 1)] == [3, 3]
    with pytest.raises(ValueError, match="kinds must have one entry per cost"):
        owner_plan([1, 2], 2, kinds=[(1,)])


@pytest.mark.parametrize("pp, ndim, requires_grad, match", [
    (ParamPolicy(update="whole"), 2, True, "update='whole'; use 'shard'"),
    (ParamPolicy(update="owner"), 2, False, "'w' is frozen, so no optimizer steps it"),
    (ParamPolicy(update="owner", placement=Replicate()), 2, True,
     "'w' has placement Replicate\\(\\) and update='owner'"),
    (ParamPolicy(update="owner", offload="cpu"), 2, True, "'w' has update='owner' and offload tier 'cpu'"),
    (ParamPolicy(update="owner", placement=Replicate()), 0, True, "'w' is 0-dim"),
])
def test_an_owner_policy_that_cannot_apply_is_refused_naming_the_parameter(pp, ndim, requires_grad, match):
    param = torch.zeros((4,) * ndim, requires_grad=requires_grad)
    with pytest.raises(PolicyError, match=match):
        resolve("w", param, MixedPrecisionPolicy(), pp, ndim)


def test_an_owner_policy_resolves_to_owner_for_a_sharded_parameter_and_to_shard_for_auto_replicated_ones():
    big, tiny = torch.zeros(64, 64, requires_grad=True), torch.zeros(3, requires_grad=True)
    assert resolve("w", big, MixedPrecisionPolicy(), ParamPolicy(update="owner"), 2).update == "owner"
    assert resolve("w", big, MixedPrecisionPolicy(), None, 2).update == "shard"
    from perparam.sharding.resolution import resolve_param
    assert resolve_param("b", tiny, MixedPrecisionPolicy(), ParamPolicy(update="owner", placement="auto"),
                         4).update \
        == "shard"


def test_perparam_plan_reports_the_owner_plan_the_runtime_computes():
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 16, bias=False), nn.Linear(16, 4))
    plan = plan_module(model, 3, param_policy={"*.weight": ParamPolicy(update="owner")})
    assert [p.name for p in plan.owner_params] == ["0.weight", "1.weight", "2.weight"]
    assert plan.owners() == plan_shapes([(16, 8), (16, 16), (4, 16)], 3)
    assert plan.owners().owners == (1, 0, 2)


def test_perparam_plan_json_and_param_policy_token_give_the_owner_plan():
    from perparam.memory.plan import plan_to_json
    from perparam.memory.policy_args import parse_param_policy

    pattern, policy = parse_param_policy("*.weight=owner")
    assert pattern == "*.weight" and policy == ParamPolicy(update="owner")
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 16, bias=False))
    owners = plan_to_json(plan_module(model, 2, param_policy={pattern: policy}))["owners"]
    assert (owners["params"] == {"0.weight": 1, "1.weight": 0}
            and owners["max_over_mean"] == pytest.approx(1.6))  # 20480 of 25600


def test_the_balance_benchmark_plays_every_rank_of_the_runtime_plan():
    from benchmarks.muon_balance import hidden_shapes, measure

    shapes = hidden_shapes(quick=True)
    result = measure(shapes, 4, rounds=1)
    assert result["planned"] == plan_shapes(shapes, 4).balance and sum(result["counts"]) == len(shapes) == 8
    assert len(result["medians_ms"]) == 4 and all(m > 0 for m in result["medians_ms"])
