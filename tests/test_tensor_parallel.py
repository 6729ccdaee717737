"""fully_shard composed with torch's tensor parallelism on a (dp_shard, tp) mesh."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import perparam
from tests.distributed import one_process, run_distributed
from tests.models import MLPNet, mean_over_ranks

STEPS, TOL = 6, 1e-5


def _data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 5, (8, 3), generator=g), torch.randn(8, 3, generator=g)) for _ in range(STEPS)]


def train(rank: int, world_size: int, clip: bool, layout: str = "1d") -> dict:
    torch.manual_seed(0)
    model = MLPNet()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    dp = 1
    if world_size and layout == "1d":
        dp, tp = world_size // 2, 2
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp_shard", "tp"))
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        perparam.fully_shard(model, mesh=mesh["dp_shard"])
    elif world_size:  # TP on an HSDP dp mesh, an HSDP norm, the rest DP-only on the flattened dp axes
        dp = world_size // 2
        mesh = init_device_mesh("cpu", (dp, 1, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        hsdp = mesh["dp_replicate", "dp_shard"]
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        perparam.fully_shard(model.up, mesh=hsdp)
        perparam.fully_shard(model.down, mesh=hsdp)
        perparam.fully_shard(model.norm, mesh=hsdp)
        perparam.fully_shard(model, mesh=hsdp._flatten("dp"))
    exact = all(torch.equal(p.full_tensor() if isinstance(p, DTensor) else p, original[n])
                for n, p in model.named_parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for x, y in _data():
        if world_size:  # batch split over dp; tp ranks of one dp group see the same rows
            dp_rank = rank // 2
            n = x.shape[0] // dp
            x, y = x[dp_rank * n:(dp_rank + 1) * n], y[dp_rank * n:(dp_rank + 1) * n]
        loss = F.mse_loss(model(x), y)
        loss.backward()
        norm = perparam.clip_grad_norm_(model.parameters(), max_norm=0.5 if clip else 1e9)
        norms.append(norm.item())
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss))
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}
    placements = {n: str(p.placements) for n, p in model.named_parameters() if isinstance(p, DTensor)}
    return {"losses": losses, "norms": norms, "params": full, "exact": exact, "placements": placements}


@pytest.mark.parametrize("layout", ["1d", pytest.param("mixed", marks=pytest.mark.fast)])
def test_fsdp_plus_tp_matches_a_single_process(layout):
    want = one_process(train, True)
    for out in run_distributed(train, 4, True, layout):
        assert out["exact"], "full_tensor() after sharding must equal the original"
        assert "_StridedShard" in out["placements"]["up.weight"] or layout == "mixed", out["placements"]
        if layout == "mixed":  # three meshes: (dp_replicate, dp_shard, tp), (dp_replicate, dp_shard), (dp,)
            assert out["placements"]["up.weight"].count("Replicate") == 1, out["placements"]
            assert out["placements"]["norm.weight"] == "(Replicate(), Shard(dim=0))", out["placements"]
            assert out["placements"]["head.weight"] == "(Shard(dim=0),)", out["placements"]
        assert max(abs(a - b) for a, b in zip(out["losses"], want["losses"])) <= TOL
        assert max(abs(a - b) for a, b in zip(out["norms"], want["norms"])) <= TOL
        for name, value in want["params"].items():
            torch.testing.assert_close(out["params"][name], value, atol=TOL, rtol=0, msg=name)


def two_meshes_in_one_process(rank: int, world_size: int) -> list[str]:
    placements = []
    for shape in ((1, 2, 2), (2, 1, 2)):
        world = init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        lin = nn.Linear(4, 4)
        parallelize_module(lin, world["tp"], ColwiseParallel())
        perparam.fully_shard(lin, mesh=world["dp_replicate", "dp_shard"])
        placements.append(str(lin.weight.placements))
    return placements


def test_a_tp_slice_of_an_equal_earlier_mesh_composes():
    # torch hands the parameter a tp slice of the first (equal) mesh; composition compares meshes by value
    for placements in run_distributed(two_meshes_in_one_process, 4):
        assert len(placements) == 2


def composition_error(rank: int, world_size: int, case: str) -> str:
    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    lin = nn.Linear(4, 4)
    parallelize_module(lin, world["tp"], ColwiseParallel())
    if case.startswith("on_dp"):  # a DTensor on the dp mesh itself (distribute_tensor, an earlier FSDP2)
        dp = init_device_mesh("cpu", (4,), mesh_dim_names=None if case == "on_dp_unnamed" else ("dp",))
        lin = nn.Linear(4, 4)
        lin.weight = nn.Parameter(distribute_tensor(lin.weight.data, dp, [Shard(0)]))
    elif case == "other_mesh":
        dp = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    elif case == "unnamed":
        dp = init_device_mesh("cpu", (4,))
    else:
        dp = world["dp_shard"]
    try:
        perparam.fully_shard(lin, mesh=dp)
    except perparam.ShardingError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("case,fragments", [
    ("other_mesh", ["'weight'", "not a sub-mesh", "slice both from one DeviceMesh"]),
    ("unnamed", ["'weight'", "axis names"]),
    ("on_dp", ["'weight'", "already a DTensor on the data-parallel mesh", "('dp',)", "full_tensor()"]),
    ("on_dp_unnamed",
     ["'weight'", "already a DTensor on the data-parallel mesh", "the same mesh", "full_tensor()"]),
])
def test_bad_tensor_parallel_compositions_fail_at_fully_shard_time(case, fragments):
    for message in run_distributed(composition_error, 4, case):
        for fragment in fragments:
            assert fragment in message, (fragment, message)


class Scale(nn.Module):
    """``x * weight``; under ``SequenceParallel`` the weight is replicated on tp and its gradient Partial."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2))

    def forward(self, x):
        return x * self.weight


#: tp rank 0's and tp rank 1's share of the weight's gradient: exact in bf16, while their sum is not
#: (1 + 2**-9 rounds to 1.0 in bf16, whose 8-bit significand cannot hold it; fp32 holds it exactly)
WITNESS = (1.0, 2.0 ** -9)


def partial_grad_witness(rank: int, world_size: int) -> list[float]:
    from torch.distributed.tensor.parallel import SequenceParallel

    dp = world_size // 2
    mesh = init_device_mesh("cpu", (dp, 2), mesh_dim_names=("dp_shard", "tp"))
    model = Scale()
    parallelize_module(model, mesh["tp"], SequenceParallel())
    perparam.fully_shard(model, mesh=mesh["dp_shard"], mp_policy=perparam.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    x = torch.full((1, 1, 2), WITNESS[mesh["tp"].get_local_rank()])  # this tp rank's sequence shard
    out = model(x)
    out.to_local().float().sum().backward()
    return model.weight.grad.full_tensor().tolist()


@pytest.mark.parametrize("world", [2, 4])
def test_reduce_dtype_governs_the_tp_reduction_of_a_partial_gradient(world):
    # dp=1 x tp=2 and dp=2 x tp=2: the tp sum of the Partial gradient happens in fp32, so it is exactly
    # 1 + 2**-9 (summed in bf16 first, as before the fix, it was 1.0)
    for grad in run_distributed(partial_grad_witness, world):
        assert grad == [sum(WITNESS)] * 2, grad
