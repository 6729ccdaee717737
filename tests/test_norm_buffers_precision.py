"""Norms with running statistics compute in their buffers' dtype whatever the call's param_dtype (a precision
island made by the rule of perparam.runtime.islands): they match one process under an fp64 param_dtype, and
run under bf16 where F.batch_norm would fail on bf16 weights with fp32 statistics."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import perparam
from perparam import MixedPrecisionPolicy
from tests.distributed import run_distributed
from tests.models import local_slice

SHAPES = {"BatchNorm1d": (3, 2), "BatchNorm2d": (3, 2, 1), "BatchNorm3d": (3, 2, 1, 1),
          "InstanceNorm1d": (3, 2), "LazyBatchNorm1d": (3, 2), "SyncBatchNorm": (3, 2)}


def make_norm(kind: str) -> nn.Module:
    if kind == "InstanceNorm1d":
        return nn.InstanceNorm1d(3, affine=True, track_running_stats=True)
    if kind == "LazyBatchNorm1d":
        return nn.LazyBatchNorm1d()
    return getattr(nn, kind)(3)


class Net(nn.Module):
    """``Linear(4, 6)`` -> the norm over 3 channels -> ``Linear(6, 2)`` (2 rows: empty shards on 3 ranks)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.shape = SHAPES[kind]
        self.fc1 = nn.Linear(4, 6)
        self.norm = make_norm(kind)
        self.fc2 = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [batch, 4] -> [batch, 2]
        h = self.norm(self.fc1(x).view(x.shape[0], *self.shape))
        return self.fc2(h.flatten(1))

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """What perparam computes under param_dtype=float64: the linears in fp64, the norm in fp32."""
        x = x.double()
        h = F.linear(x, self.fc1.weight.double(), self.fc1.bias.double()).view(x.shape[0], *self.shape)
        h = self.norm(h.float()).double()
        return F.linear(h.flatten(1), self.fc2.weight.double(), self.fc2.bias.double())


def build(kind: str) -> Net:
    torch.manual_seed(0)
    model = Net(kind)
    if kind == "LazyBatchNorm1d":
        model(torch.randn(2, 4))  # initialise the lazy norm (it becomes a BatchNorm1d)
    with torch.no_grad():  # non-trivial affine parameters
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.5, 0.5)
    return model


def steps(rank: int, world: int, kind: str, sharded: bool) -> dict:
    """Three SGD steps; each rank normalises with its own batch's statistics (data parallel), which the
    one-process reference reproduces by running each rank's slice and averaging the losses."""
    model = build(kind)
    if sharded:
        perparam.fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    out_dtype = None
    for _ in range(3):
        x, y = torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g, dtype=torch.float64)
        if sharded:
            out = model(local_slice(x, rank, world))
            out_dtype = out.dtype
            F.mse_loss(out, local_slice(y, rank, world)).backward()
        else:
            losses = [F.mse_loss(model.reference(local_slice(x, r, world)), local_slice(y, r, world))
                      for r in range(world)]
            (sum(losses) / world).backward()
        opt.step()
        opt.zero_grad()
    params = {n: (p.full_tensor() if sharded else p).detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "out_dtype": out_dtype, "stats_dtype": model.norm.running_mean.dtype}


@pytest.mark.parametrize("kind,world", [("BatchNorm1d", 3), ("BatchNorm2d", 2), ("BatchNorm3d", 2),
                                        ("InstanceNorm1d", 3), ("LazyBatchNorm1d", 2)])
def test_a_norm_with_running_statistics_computes_in_their_dtype_and_matches_one_process(kind, world):
    ref = steps(0, world, kind, False)
    got = run_distributed(steps, world, kind, True)[0]
    assert got["out_dtype"] == torch.float64 and got["stats_dtype"] == torch.float32
    for name, value in ref["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=0, atol=1e-5, msg=name)


def bf16_runs(rank: int, world: int) -> dict:
    out = {}
    for kind in SHAPES:
        model = build(kind)
        perparam.fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        if kind == "SyncBatchNorm":
            model.eval()  # on CPU torch's SyncBatchNorm trains on GPUs only; evaluation runs F.batch_norm
        y = model(torch.randn(4, 4))
        if model.training:
            y.float().sum().backward()
        group = model.__dict__["_perparam_group"]
        compute = {sp.fqn: sp.policy.param_dtype for sp in group.params}
        out[kind] = (y.dtype, compute["norm.weight"], compute["fc1.weight"], bool(torch.isfinite(y).all()))
    return out


@pytest.mark.fast
def test_norms_with_running_statistics_run_under_bf16_param_dtype_in_fp32():
    for kind, (out_dtype, norm_dtype, linear_dtype, finite) in run_distributed(bf16_runs, 2)[0].items():
        assert (out_dtype, norm_dtype, linear_dtype, finite) == (torch.bfloat16, torch.float32,
                                                                 torch.bfloat16, True), kind
