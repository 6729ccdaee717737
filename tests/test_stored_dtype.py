"""The stored dtype of sharded parameters: master weights, the low-precision warning, and ``.to(dtype)``
after ``fully_shard`` (refused, nothing changed); ignored parameters stay as the user made them."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import perparam
from perparam import CommCounter, MixedPrecisionPolicy
from tests.distributed import run_distributed


def master_weights(rank: int, world_size: int, master: bool) -> dict:
    import perparam.api

    perparam.api._WARNED_LOW_PRECISION = False
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2)).to(torch.bfloat16)  # "loaded in bf16"
    mp = MixedPrecisionPolicy(master_dtype=torch.float32 if master else None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        perparam.fully_shard(model, mp_policy=mp)
        perparam.fully_shard(nn.Linear(2, 2, dtype=torch.bfloat16), mp_policy=mp)  # a second call: no second warning
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    with CommCounter() as comm:
        model(x).float().pow(2).mean().backward()
    opt.step()
    state = opt.state[model[0].weight]
    return {"warnings": [str(w.message) for w in caught if "master_dtype" in str(w.message)],
            "shard": model[0].weight.dtype, "grad": model[0].weight.grad.dtype, "exp_avg": state["exp_avg"].dtype,
            "gather_dtypes": {r.dtype for r in comm.records if r.kind == "all_gather"}}


@pytest.mark.parametrize("master", [True, False])
def test_master_weights_keep_fp32_shards_grads_and_optimizer_state_with_a_bf16_all_gather(master):
    for got in run_distributed(master_weights, 2, master):
        want = torch.float32 if master else torch.bfloat16
        assert (got["shard"], got["grad"], got["exp_avg"]) == (want, want, want)
        assert got["gather_dtypes"] <= {torch.bfloat16, torch.uint8}, got["gather_dtypes"]
        assert len(got["warnings"]) == (0 if master else 1), got["warnings"]


def dtype_change(rank: int, world_size: int, how: str) -> dict:
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    perparam.fully_shard(model[0])
    perparam.fully_shard(model)
    before = {n: (p.dtype, p.to_local().clone()) for n, p in model.named_parameters()}
    error = None
    try:
        {"bf16": lambda: model.to(torch.bfloat16), "double": model.double, "half": model.half,
         "child_half": model[1].half}[how]()  # model[1] is in the root's group, not passed to fully_shard
    except perparam.StoredDtypeChangeError as e:
        error = str(e)
    unchanged = all(p.dtype == before[n][0] and torch.equal(p.to_local(), before[n][1])
                    for n, p in model.named_parameters())
    model.float()  # no dtype change: allowed
    model.to("cpu")
    out = model(torch.randn(2, 3))  # still trains as before
    F.mse_loss(out, torch.zeros_like(out)).backward()
    return {"error": error, "unchanged": unchanged, "grad": model[1].weight.grad is not None}


@pytest.mark.parametrize("how", ["bf16", "double", "half", "child_half"])
def test_changing_the_stored_dtype_after_fully_shard_is_refused_before_anything_changes(how):
    for got in run_distributed(dtype_change, 2, how):
        assert got["error"] is not None and "before fully_shard" in got["error"] and "param_dtype" in got["error"]
        assert got["unchanged"] and got["grad"]


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
            "lin": isinstance(model.lin.weight.data, DTensor), "packed_in_sd": torch.equal(sd["packed"], model.packed),
            "gather_bytes": comm.bytes("all_gather"),
            "other_sharded": all(isinstance(p, DTensor) for p in other.parameters())}


def test_ignored_params_stay_plain_tensors_outside_every_collective_and_foreign_ones_are_skipped():
    for got in run_distributed(ignored, 2):
        assert got["plain"] and got["dtype"] == torch.int8 and got["lin"] and got["packed_in_sd"]
        # only the Linear travels: (16 + 4) fp32 elements over 2 ranks, gathered
        assert got["gather_bytes"] == (8 + 2) * 4 * 2, got["gather_bytes"]
        assert got["other_sharded"]  # ignored_params of another module: skipped, as FSDP2 does
