"""A ``param_policy`` pattern may name any of a tied parameter's names (``lm_head.weight`` tied to
``embed.weight``), in ``fully_shard`` and in ``perparam plan``; two patterns giving different policies to
two names of one parameter are refused, naming both."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import perparam
from perparam import ParamPolicy
from perparam.memory.plan import plan_module

pytestmark = pytest.mark.fast


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 10, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, tokens):
        return self.lm_head(self.norm(self.embed(tokens)))


FROZEN = ParamPolicy(requires_grad=False, placement=Replicate())


def test_a_pattern_on_the_second_name_of_a_tied_parameter_applies(fake_mesh):
    model = TiedLM()
    perparam.fully_shard(model, mesh=fake_mesh, param_policy={"lm_head.weight": FROZEN})
    assert model.embed.weight is model.lm_head.weight
    assert model.embed.weight.placements == (Replicate(),) and not model.embed.weight.requires_grad
    assert model.norm.weight.placements == (Shard(0),)
    model(torch.tensor([[1, 2, 3]])).sum().backward()  # runs; the frozen tied weight gets no gradient
    assert model.embed.weight.grad is None and model.norm.weight.grad is not None


def test_equal_policies_on_both_names_are_accepted(fake_mesh):
    model = TiedLM()
    perparam.fully_shard(model, mesh=fake_mesh, param_policy={"embed.weight": FROZEN, "lm_head.*": FROZEN})
    assert model.embed.weight.placements == (Replicate(),)


def test_conflicting_policies_on_two_names_of_one_parameter_are_refused(fake_mesh):
    model = TiedLM()
    policy = {"embed.*": ParamPolicy(param_dtype=torch.bfloat16), "lm_head.weight": FROZEN}
    with pytest.raises(perparam.ShardingError) as err:
        perparam.fully_shard(model, mesh=fake_mesh, param_policy=policy)
    for word in ("'embed.*'", "'embed.weight'", "'lm_head.weight'", "tied"):
        assert word in str(err.value)
    assert not isinstance(model.embed.weight, DTensor)  # nothing changed
    with torch.device("meta"):
        meta = TiedLM()
    with pytest.raises(ValueError, match="'lm_head.weight'"):
        plan_module(meta, 2, param_policy=policy)


def test_plan_resolves_a_pattern_on_the_second_name_like_fully_shard():
    with torch.device("meta"):
        model = TiedLM()
    plan = plan_module(model, 2, dtype=None, param_policy={"lm_head.weight": FROZEN})
    (embed,) = [p for p in plan.params if p.name == "embed.weight"]
    assert embed.placements == (Replicate(),) and not embed.requires_grad
    assert [p.name for p in plan.params] == ["embed.weight", "norm.weight", "norm.bias"]  # counted once
