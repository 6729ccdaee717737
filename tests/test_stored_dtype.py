"""The stored dtype of sharded parameters: master weights, the low-precision warning, and ``.to(dtype)``
after ``fully_shard`` (the shards cast, training on like one process cast alike; refused, nothing changed,
where perparam cannot follow); ignored parameters stay as the user made them."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import perparam
from perparam import CommCounter, MixedPrecisionPolicy
from tests.distributed import one_process, run_distributed
from tests.models import TinyNet, full_params, local_slice, make_batches


def master_weights(rank: int, world_size: int, master: bool) -> dict:
    import perparam.api

    perparam.api._WARNED_LOW_PRECISION = False
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2)).to(torch.bfloat16)  # "loaded in bf16"
    mp = MixedPrecisionPolicy(master_dtype=torch.float32 if master else None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        perparam.fully_shard(model, mp_policy=mp)
        # a second call: no second warning
        perparam.fully_shard(nn.Linear(2, 2, dtype=torch.bfloat16), mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    with CommCounter() as comm:
        model(x).float().pow(2).mean().backward()
    opt.step()
    state = opt.state[model[0].weight]
    return {"warnings": [str(w.message) for w in caught if "master_dtype" in str(w.message)],
            "shard": model[0].weight.dtype, "grad": model[0].weight.grad.dtype,
            "exp_avg": state["exp_avg"].dtype,
            "gather_dtypes": {r.dtype for r in comm.records if r.kind == "all_gather"}}


@pytest.mark.parametrize("master", [True, False])
def test_master_weights_keep_fp32_shards_grads_and_optimizer_state_with_a_bf16_all_gather(master):
    for got in run_distributed(master_weights, 2, master):
        want = torch.float32 if master else torch.bfloat16
        assert (got["shard"], got["grad"], got["exp_avg"]) == (want, want, want)
        assert got["gather_dtypes"] <= {torch.bfloat16, torch.uint8}, got["gather_dtypes"]
        assert len(got["warnings"]) == (0 if master else 1), got["warnings"]


def cast_run(rank: int, world_size: int, how: str, when: str, stage: int) -> dict:
    """TinyNet (uneven and empty shards) cast with ``how`` after ``fully_shard`` (``when``: before the first
    forward, or after one fp32 step), trained with SGD on each rank's slice; ``world_size == 0``: one process
    cast the same way."""
    torch.manual_seed(0)
    model = TinyNet()
    if world_size:
        policy = {"*": perparam.ParamPolicy(zero_stage=stage)} if stage != 3 else None
        for block in model.blocks:
            perparam.fully_shard(block, param_policy=policy)
        perparam.fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gathered = []

    def step(x, y):
        if world_size:
            x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        with CommCounter() as comm:
            out = model(x)
            F.mse_loss(out, y.to(out.dtype)).backward()
        gathered.append(comm.bytes("all_gather"))
        opt.step()
        opt.zero_grad()
        return out.dtype

    batches = make_batches(4, 12)
    if when == "after_step":
        step(*batches.pop(0))
    {"double": model.double, "to": lambda: model.to(torch.float64), "half": model.half,
     "children": lambda: [m.double() for m in model.children()]}[how]()  # each group relaid out in parts
    out_dtypes = [step(x, y) for x, y in batches]
    return {"params": full_params(model), "out": out_dtypes, "gathered": gathered,
            "dtypes": {n: p.dtype for n, p in model.named_parameters()},
            "grads": {n: p.grad is None for n, p in model.named_parameters()}}


@pytest.mark.parametrize("how,when,stage,world_size", [
    ("double", "before_forward", 3, 4), pytest.param("to", "after_step", 2, 3, marks=pytest.mark.fast),
    ("children", "after_step", 1, 2), ("half", "after_step", 3, 2), ("double", "after_step", 3, 1)])
def test_a_float_cast_after_fully_shard_casts_the_shards_and_trains_like_one_process_cast_alike(
        how, when, stage, world_size):
    want = one_process(cast_run, how, when, stage)
    # fp16 sums in another order; a first step in fp32 within its rounding; float64 throughout within its own
    tol = 2e-3 if how == "half" else 1e-6 if when == "after_step" else 1e-12
    for got in run_distributed(cast_run, world_size, how, when, stage):
        assert got["dtypes"] == {n: p.dtype for n, p in want["params"].items()}
        assert got["out"] == want["out"]
        for name, value in want["params"].items():
            torch.testing.assert_close(got["params"][name], value, rtol=0, atol=tol, msg=name)
        if how in ("double", "to") and world_size > 1:  # the all-gathers carry 8-byte elements now
            assert got["gathered"][-1] > got["gathered"][0] if when == "after_step" else True


def cast_policies(rank: int, world_size: int) -> dict:
    """The compute dtype a policy gave stays; the one that followed the stored dtype follows the cast."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    perparam.fully_shard(model[1], mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    perparam.fully_shard(model)
    model.double()
    computed = {}
    for i, m in enumerate(model):
        m.register_forward_pre_hook(lambda mod, a, i=i: computed.update({i: mod.weight.dtype}))  # gathered
        m.register_forward_hook(lambda mod, a, out, i=i: computed.update({i: (computed[i], out.dtype)}))
    out = model(torch.randn(2, 3, dtype=torch.float64))
    out.float().sum().backward()
    return {"shards": {n: p.dtype for n, p in model.named_parameters()},
            "grads": {n: p.grad.dtype for n, p in model.named_parameters()}, "computed": computed}


def test_a_cast_keeps_a_param_dtype_the_policy_set_and_moves_one_that_followed_the_stored_dtype():
    for got in run_distributed(cast_policies, 2):
        assert (set(got["shards"].values()) == {torch.float64}
                and set(got["grads"].values()) == {torch.float64})
        assert got["computed"] == {0: (torch.float64, torch.float64), 1: (torch.bfloat16, torch.bfloat16)}


def refused_casts(rank: int, world_size: int) -> dict:
    out = {}
    quantized = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    perparam.fully_shard(quantized, param_policy={"0.weight": perparam.ParamPolicy(
        requires_grad=False, quant=perparam.QuantPolicy("int8", store_quantized=True))})
    offloaded = nn.Sequential(nn.Linear(4, 2))
    perparam.fully_shard(offloaded, offload_policy=perparam.OffloadPolicy("cpu", "all"))
    held = nn.Sequential(nn.Linear(4, 2))
    perparam.fully_shard(held)
    held.set_requires_gradient_sync(False)
    held(torch.randn(2, 4)).sum().backward()
    for name, model in (("quantized", quantized), ("offloaded", offloaded), ("held", held)):
        before = {n: (p.dtype, p.to_local().clone()) for n, p in model.named_parameters()}
        try:
            model.double()
            out[name] = "no error"
        except perparam.StoredDtypeChangeError as e:
            out[name] = str(e)
        assert all(p.dtype == before[n][0] and torch.equal(p.to_local(), before[n][1])
                   for n, p in model.named_parameters()), name
    stepped = nn.Sequential(nn.Linear(4, 2))
    perparam.fully_shard(stepped)
    opt = torch.optim.AdamW(stepped.parameters())
    stepped(torch.randn(2, 4)).sum().backward()
    opt.step()
    try:
        stepped.double()
        out["stepped"] = "no error"
    except perparam.StoredDtypeChangeError as e:
        out["stepped"] = str(e)
    for state in opt.state.values():  # the fix the message gives: the state first, then the model
        state.update({k: v.to(torch.float64) for k, v in state.items() if v.is_floating_point() and v.dim()})
    stepped.double()
    stepped(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
    opt.step()
    out["fp8"] = "no error"
    try:
        held.to(torch.float8_e4m3fn)
    except perparam.StoredDtypeChangeError as e:
        out["fp8"] = str(e)
    return out


def test_casts_perparam_cannot_follow_are_refused_naming_the_parameter_before_anything_changes():
    for got in run_distributed(refused_casts, 2):
        assert "'0.weight'" in got["quantized"] and "stored quantized" in got["quantized"], got["quantized"]
        assert "'0.weight'" in got["offloaded"] and "'cpu'" in got["offloaded"], got["offloaded"]
        assert "accumulated without sync" in got["held"] and "Nothing was changed" in got["held"], got["held"]
        assert "float8_e4m3fn" in got["fp8"], got["fp8"]
        assert ("'0.weight'" in got["stepped"]
                and "AdamW holds its state 'exp_avg'" in got["stepped"]), got["stepped"]


def owner_cast(rank: int, world_size: int) -> dict:
    """Muon on two owner matrices (Linear(8, 6), Linear(6, 5)) over 3 ranks: after a step rank 2 owns
    neither and holds no state, yet the cast must be refused there too; after the state is cast on the
    owners (the message's fix) the cast goes through on every rank and a float64 step runs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6, bias=False), nn.Tanh(), nn.Linear(6, 5, bias=False))
    perparam.fully_shard(model, param_policy=perparam.ParamPolicy(update="owner"))
    opt = torch.optim.Muon(model.parameters(), lr=0.05)
    F.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 5)).backward()
    opt.step()
    opt.zero_grad()
    out = {"held": sum(1 for s in opt.state.values() if s)}  # (the others: an empty entry per matrix)
    try:
        model.double()
        out["cast"] = "no error"
    except perparam.StoredDtypeChangeError as e:
        out["cast"] = str(e)
    out["dtype"] = str(model[0].weight.dtype)
    for state in opt.state.values():
        state.update({k: v.to(torch.float64) for k, v in state.items() if v.is_floating_point() and v.dim()})
    model.double()
    F.mse_loss(model(torch.randn(4, 8, dtype=torch.float64)),
               torch.randn(4, 5, dtype=torch.float64)).backward()
    opt.step()
    out["after"] = str(model[2].weight.dtype)
    return out


def test_a_cast_refused_for_an_owner_parameter_is_refused_on_every_rank_alike():
    results = run_distributed(owner_cast, 3)
    assert sorted(r["held"] for r in results) == [0, 1, 1]  # one rank owns nothing, holds no state
    messages = {r["cast"] for r in results}
    assert len(messages) == 1, messages  # was: the owners refused, the rank without state cast
    assert "Muon holds its state 'momentum_buffer'" in messages.pop()
    assert all(r["dtype"] == "torch.float32" and r["after"] == "torch.float64" for r in results)


class Packed(nn.Module):
    """A layer whose int8 ``packed`` weight is managed elsewhere (as accelerate does for 4-bit weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.packed = nn.Parameter(torch.arange(16, dtype=torch.int8).view(4, 4), requires_grad=False)

    def forward(self, x):
        return self.lin(x) + self.packed.float().sum()


def ignored(rank: int, world_size: int) -> dict:
    model = Packed()
    perparam.fully_shard(model, ignored_params={model.packed})
    with CommCounter() as comm:
        out = model(torch.randn(2, 4))
        out.sum().backward()
    sd = model.state_dict()
    model.load_state_dict(sd)
    # as FSDP2: parameters outside the module (one set passed to every call) are not this call's concern
    other = nn.Linear(2, 2)
    perparam.fully_shard(other, ignored_params={model.lin.bias, model.packed})
    with pytest.raises(perparam.ShardingError, match="set of parameters"):
        perparam.fully_shard(nn.Linear(2, 2), ignored_params=model.lin.bias)
    return {"plain": not isinstance(model.packed.data, DTensor), "dtype": model.packed.dtype,
            "lin": isinstance(model.lin.weight.data, DTensor),
            "packed_in_sd": torch.equal(sd["packed"], model.packed), "gather_bytes": comm.bytes("all_gather"),
            "other_sharded": all(isinstance(p, DTensor) for p in other.parameters())}


def test_ignored_params_stay_plain_tensors_outside_every_collective_and_foreign_ones_are_skipped():
    for got in run_distributed(ignored, 2):
        assert got["plain"] and got["dtype"] == torch.int8 and got["lin"] and got["packed_in_sd"]
        # only the Linear travels: (16 + 4) fp32 elements over 2 ranks, gathered
        assert got["gather_bytes"] == (8 + 2) * 4 * 2, got["gather_bytes"]
        assert got["other_sharded"]  # ignored_params of another module: skipped, as FSDP2 does
