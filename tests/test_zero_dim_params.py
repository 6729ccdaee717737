"""0-dim parameters: replicated with ``ParamPolicy(placement=Replicate())`` or ``placement="auto"``, their
gradients all-reduced in the ``reduce_dtype`` with the group's other replicated parameters (one all-reduce),
and a model holding them trains like one process (2 ranks, AdamW, fp32 within 1e-5)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import perparam
from perparam import CommCounter, MixedPrecisionPolicy, ParamPolicy
from tests.distributed import run_distributed

STEPS, BATCH, TOL = 4, 8, 1e-5
EXPLICIT = {"scale": ParamPolicy(placement=Replicate()), "shift": ParamPolicy(placement=Replicate())}


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(80, 5)  # (5, 80) fp32: 1600 bytes, sharded (Shard(1) under "auto" at K = 2)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.shift = nn.Parameter(torch.tensor(-0.25))

    def forward(self, x):
        return self.scale * self.lin(x) + self.shift


def _model() -> nn.Module:
    torch.manual_seed(0)
    return Scaled()


def _data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 80, generator=g), torch.randn(BATCH, 5, generator=g)) for _ in range(STEPS)]


def _train(model, rank: int = 0, world: int = 1, comm: list | None = None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    n = BATCH // world
    for step, (x, y) in enumerate(_data()):
        with CommCounter() as counter:
            F.mse_loss(model(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n]).backward()
        if comm is not None and step == 1:
            comm.extend((r.kind, r.dtype) for r in counter.records)
        opt.step()
        opt.zero_grad()


def sharded(rank: int, world: int, auto: bool):
    model = _model()
    if auto:
        perparam.fully_shard(model, param_policy=ParamPolicy(placement="auto"))
    else:
        perparam.fully_shard(model, param_policy=EXPLICIT,
                             mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float64))
    placements = {n: p.placements for n, p in model.named_parameters()}
    comm: list = []
    _train(model, rank, world, comm)
    return placements, comm, {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


@pytest.mark.fast
def test_0_dim_parameters_replicated_train_like_one_process():
    ref = _model()
    _train(ref)
    for auto in (False, True):
        for placements, comm, params in run_distributed(sharded, 2, auto):
            assert placements["scale"] == placements["shift"] == (Replicate(),)
            assert placements["lin.weight"] == ((Shard(1),) if auto else (Shard(0),))
            if not auto:
                # one all-gather (the root keeps it for backward), one reduce-scatter, and one all-reduce
                # for the replicated scalars, in the reduce dtype
                assert sorted(comm, key=str) == sorted([("all_gather", torch.uint8),
                                                        ("reduce_scatter", torch.float64),
                                                        ("all_reduce", torch.float64)], key=str), comm
            for name, p in ref.named_parameters():
                assert params[name].shape == p.shape
                torch.testing.assert_close(params[name], p.detach(), atol=TOL, rtol=TOL)


def test_0_dim_parameter_without_a_replicating_placement_is_refused_and_told_what_to_pass():
    import pytest

    for policy in (None, ParamPolicy(placement=Shard(0)), {"scale": ParamPolicy(param_dtype=torch.float32)}):
        with pytest.raises(perparam.ShardingError,
                           match=r"'scale' is 0-dim.*ParamPolicy\(placement=Replicate\(\)\)"):
            perparam.fully_shard(Scaled(), param_policy=policy, mesh=_one_rank_mesh())


def _one_rank_mesh():
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.arange(1), _init_backend=False, _rank=0)
