"""Torch's own utilities on a sharded model: merging a parametrization trains like one process; what
perparam cannot follow is refused at the call, leaving the model as it was; never a silent wrong result."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize, prune

import perparam
from perparam.module import ShardedModule
from tests.distributed import one_process, run_distributed
from tests.models import local_slice


class LowRank(nn.Module):
    """``w + a @ b``: a LoRA adapter as a parametrization (rank 1)."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.a = nn.Parameter(torch.randn(out_features, 1, generator=g) * 0.5)
        self.b = nn.Parameter(torch.randn(1, in_features, generator=g) * 0.5)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w + self.a @ self.b


def build() -> nn.Module:
    """``Linear(4, 2)`` (2 rows: empty shards on 3 ranks) with an adapter, then ``Linear(2, 3)``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2), nn.Tanh(), nn.Linear(2, 3))
    parametrize.register_parametrization(model[0], "weight", LowRank(2, 4))
    return model


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g)) for _ in range(3)]


def merge_and_train(rank: int, world: int, sharded: bool, own_group: bool, unshard: bool) -> dict:
    """One SGD step with the adapter, ``remove_parametrizations(leave_parametrized=True)`` (after
    ``unshard()`` when asked), two more steps; the parameters at the end, in full."""
    model = build()
    if sharded:
        if own_group:
            perparam.fully_shard(model[0])
        perparam.fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    owner = model[0] if own_group else model
    for i, (x, y) in enumerate(batches()):
        if i == 1:
            if sharded and unshard:
                owner.unshard()
            parametrize.remove_parametrizations(model[0], "weight", leave_parametrized=True)
            if sharded and unshard:
                owner.reshard()
        if sharded:
            x, y = local_slice(x, rank, world), local_slice(y, rank, world)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    full = {n: (p.full_tensor() if sharded else p).detach().clone() for n, p in model.named_parameters()}
    return {"params": full, "class": type(model[0]).__name__,
            "sharded_module": isinstance(model[0], ShardedModule)}


@pytest.mark.parametrize("world,own_group,unshard", [(3, False, False), (3, True, True), (2, False, True)],
                         ids=["in_parent_group", "own_group_after_unshard", "after_unshard"])
def test_merging_a_parametrization_after_sharding_trains_like_one_process(world, own_group, unshard):
    ref = merge_and_train(0, 1, False, own_group, unshard)
    got = run_distributed(merge_and_train, world, True, own_group, unshard)[0]
    assert list(got["params"]) == list(ref["params"]) == ["0.bias", "0.weight", "2.weight", "2.bias"]
    for name, value in ref["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=0, atol=1e-5, msg=name)
    assert ref["class"] == "Linear"
    assert got["class"] == ("ShardedLinear" if own_group else "Linear") and got["sharded_module"] == own_group


def _apply(name: str, model: nn.Module) -> None:
    lin = model[0]
    if name == "weight_norm":
        torch.nn.utils.weight_norm(lin)
    elif name == "spectral_norm":
        torch.nn.utils.spectral_norm(lin)
    elif name == "parametrizations.weight_norm":
        torch.nn.utils.parametrizations.weight_norm(lin)
    elif name == "register_parametrization":
        parametrize.register_parametrization(lin, "weight", LowRank(2, 4))
    elif name == "prune":
        prune.l1_unstructured(lin, "weight", 0.5)
    elif name == "tie":
        model[2].weight = lin.weight
    elif name == "prepare_qat":
        model.qconfig = torch.ao.quantization.get_default_qat_qconfig("fbgemm")
        torch.ao.quantization.prepare_qat(model, inplace=True)
    elif name == "assign":
        lin.weight = nn.Parameter(torch.zeros(2, 4))
    elif name == "new_submodule":
        model.extra = nn.Linear(3, 3)
    elif name == "to_empty":
        model.to_empty(device="cpu")
    else:
        raise AssertionError(name)


REFUSED = ["weight_norm", "spectral_norm", "parametrizations.weight_norm", "register_parametrization",
           "prune", "tie", "prepare_qat", "assign", "new_submodule", "to_empty"]


def refuse_all(rank: int, world: int) -> dict:
    out = {}
    for name in REFUSED:
        for unshard in (False, True):
            if name == "to_empty" and not unshard:
                continue  # to_empty of a sharded model is supported (the shards are materialised)
            model = nn.Sequential(nn.Linear(4, 2), nn.Tanh(), nn.Linear(2, 3))
            perparam.fully_shard(model)
            before = {n: p for n, p in model.named_parameters()}
            if unshard:
                model.unshard()
            try:
                _apply(name, model)
                message = "no error"
            except RuntimeError as e:
                message = f"{type(e).__name__}: {e}"
            if unshard:
                model.reshard()
            after = {n: p for n, p in model.named_parameters()}
            unchanged = list(after) == list(before) and all(after[n] is before[n] for n in before)
            model(torch.randn(2, 4)).sum().backward()  # still trains
            out[f"{name}{' after unshard' if unshard else ''}"] = (message, unchanged)
    return out


@pytest.mark.fast
def test_utilities_perparam_cannot_follow_are_refused_at_the_call_leaving_the_model_as_it_was():
    for case, (message, unchanged) in run_distributed(refuse_all, 2)[0].items():
        assert message != "no error", case
        assert "perparam" in message, (case, message)
        if case.startswith("to_empty"):
            assert "reshard() on the sharded module first" in message, (case, message)
        elif case.startswith("assign"):
            assert "'0.weight'" in message and "replaced after fully_shard" in message, (case, message)
        else:
            assert "before fully_shard" in message and "full_state_dict" in message, (case, message)
        assert unchanged, case


def removed_then_forward(rank: int, world: int) -> str:
    model = nn.Sequential(nn.Linear(4, 2), nn.Tanh(), nn.Linear(2, 3))
    perparam.fully_shard(model)
    del model[2].weight  # no registration hook sees a deletion: the next forward refuses it
    try:
        model(torch.randn(2, 4))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_parameter_deleted_after_sharding_is_refused_at_the_next_forward():
    message = run_distributed(removed_then_forward, 2)[0]
    assert "'2.weight'" in message and "removed after fully_shard" in message, message


def lbfgs_steps(rank: int, world: int, policy) -> dict:
    """Two LBFGS steps (3 iterations each) of ``Linear(4, 3) -> Linear(3, 2)`` on a global batch of 6:
    the parameters at the end in full, or the error the first step raised (the parameters then as built)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    built = {n: p.detach().clone() for n, p in model.named_parameters()}
    if world:
        perparam.fully_shard(model, param_policy=policy)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)
    if world:
        x, y = local_slice(x, rank, world), local_slice(y, rank, world)

    def closure():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    try:
        for _ in range(2):
            opt.step(closure)
        error = None
    except perparam.UnflattenableShardError as e:
        error = str(e)
    params = {n: (p.full_tensor() if world else p).detach().clone() for n, p in model.named_parameters()}
    return {"error": error, "params": params, "built": built}


def lbfgs_default_then_auto(rank: int, world: int) -> list[dict]:
    return [lbfgs_steps(rank, world, None), lbfgs_steps(rank, world, perparam.ParamPolicy(placement="auto"))]


@pytest.mark.fast
def test_lbfgs_on_uneven_shards_is_refused_at_its_first_step_and_trains_like_one_process_when_even():
    """2 ranks: ``0.weight`` (3 rows) cannot be flattened; ``placement="auto"`` shards it on its 4 columns
    (and replicates the tiny biases), and LBFGS then matches one process."""
    ref = one_process(lbfgs_steps, None)
    for refused, auto in run_distributed(lbfgs_default_then_auto, 2):
        # every rank refuses, before the step changed anything
        assert "LBFGS" in refused["error"] and "'0.weight'" in refused["error"], refused["error"]
        assert "placement='auto'" in refused["error"] and "Replicate()" in refused["error"], refused["error"]
        for name, value in refused["built"].items():
            torch.testing.assert_close(refused["params"][name], value, rtol=0, atol=0, msg=name)
        assert auto["error"] is None
        for name, value in ref["params"].items():
            torch.testing.assert_close(auto["params"][name], value, rtol=0, atol=1e-5, msg=name)
