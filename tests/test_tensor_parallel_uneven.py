"""A tensor-parallel dim that does not divide the tp axis (9 or 27 rows over tp = 2), composed with
fully_shard.

DTensor (and FSDP2) give tp rank 0 the larger chunk (``torch.chunk``: 5 and 4 of 9 rows); each data-parallel
group shares one tp coordinate, so each rank lays its dp shards out from its own tp-local shape and every rank
of one dp group issues the same collectives with the same sizes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import perparam
from perparam.sharding.placement import chunk_extent
from tests.distributed import one_process, run_distributed

TOL = 1e-5


class Stack(nn.Module):
    """``down(relu(up(x)))`` with ``hidden`` rows in ``up`` (colwise) and columns in ``down`` (rowwise)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(6, hidden)
        self.down = nn.Linear(hidden, 5)

    def forward(self, x):
        y = self.down(F.relu(self.up(x)))
        return y.full_tensor() if isinstance(y, DTensor) else y


def shard(model: Stack, world_size: int, variant: str) -> None:
    if variant == "hsdp":  # (dp_replicate, dp_shard, tp): the dp mesh is 2-D
        world = init_device_mesh("cpu", (world_size // 2, 1, 2),
                                 mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        mesh = {"tp": world["tp"], "dp_shard": world["dp_replicate", "dp_shard"]}
    else:
        mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp_shard", "tp"))
    # use_local_output=False keeps the uneven activation a DTensor, as FSDP2's MLPStack does
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(use_local_output=False),
                                           "down": RowwiseParallel(use_local_output=False)})
    kwargs = {"reshard_after_forward": False} if variant == "no_reshard" else {}
    if variant.startswith("zero"):
        kwargs["param_policy"] = perparam.ParamPolicy(zero_stage=int(variant[-1]))
    if variant == "nested":
        perparam.fully_shard(model.up, mesh=mesh["dp_shard"])
    perparam.fully_shard(model, mesh=mesh["dp_shard"], **kwargs)


def train(rank: int, world_size: int, hidden: int, variant: str = "default") -> dict:
    torch.manual_seed(0)
    model = Stack(hidden)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    dp = world_size // 2 if world_size else 1
    if world_size:
        shard(model, world_size, variant)
    params = dict(model.named_parameters())
    exact = all(torch.equal(p.full_tensor() if isinstance(p, DTensor) else p, original[n])
                for n, p in params.items())
    # DTensor's own arithmetic for this rank's piece must name the rows this rank holds
    spec_ok = all(tuple(p.to_local().shape) == tuple(compute_local_shape_and_global_offset(
        p.shape, p.device_mesh, p.placements)[0]) for p in params.values() if isinstance(p, DTensor))
    local = {n: tuple(p.to_local().shape) for n, p in params.items() if isinstance(p, DTensor)}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(3):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 5, generator=g)
        if world_size:  # the batch split over dp; the tp ranks of one dp group see the same rows
            n, r = 8 // dp, rank // 2
            x, y = x[r * n:(r + 1) * n], y[r * n:(r + 1) * n]
        loss = F.mse_loss(model(x), y)
        loss.backward()
        perparam.clip_grad_norm_(model.parameters(), max_norm=0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in params.items()}
    return {"exact": exact, "spec_ok": spec_ok, "local": local, "params": full}


def expected_rows(hidden: int, rank: int) -> int:
    """Rows of ``up.weight`` rank ``rank`` of a (2 dp x 2 tp) mesh holds: torch.chunk over tp, then over
    dp."""
    dp_rank, tp_rank = divmod(rank, 2)
    _, tp_rows = chunk_extent(hidden, 2, tp_rank)
    return chunk_extent(tp_rows, 2, dp_rank)[1]


@pytest.mark.parametrize("hidden", [9, 27, 3, 1])  # 3: an empty dp shard; 1: an empty tp shard
def test_an_uneven_tp_dim_trains_like_one_process_and_each_rank_holds_its_chunk(hidden):
    # before: fully_shard refused 9 rows over tp = 2 ("does not divide over the tp axis of size 2")
    want = one_process(train, hidden)
    for rank, out in enumerate(run_distributed(train, 4, hidden)):
        assert out["exact"] and out["spec_ok"], out["local"]
        assert out["local"]["up.weight"] == (expected_rows(hidden, rank), 6), (rank, out["local"])
        for name, value in want["params"].items():
            torch.testing.assert_close(out["params"][name], value, atol=TOL, rtol=0, msg=name)


@pytest.mark.parametrize("variant", ["no_reshard", "zero1", "zero2", "nested", "hsdp"])
def test_an_uneven_tp_dim_trains_like_one_process_in_every_variant(variant):
    want = one_process(train, 9)
    for out in run_distributed(train, 4, 9, variant):
        assert out["exact"] and out["spec_ok"], out["local"]
        for name, value in want["params"].items():
            torch.testing.assert_close(out["params"][name], value, atol=TOL, rtol=0, msg=(variant, name))


def _adam_steps(model: Stack, rank: int, world_size: int) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 5, generator=g)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return opt


def _full_state(model: Stack, opt: torch.optim.Optimizer) -> dict:
    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
    out = {n: full(p) for n, p in model.named_parameters()}
    out.update({f"{n}.exp_avg_sq": full(opt.state[p]["exp_avg_sq"]) for n, p in model.named_parameters()})
    return out


def save_uneven(rank: int, world_size: int, path: str) -> dict:
    torch.manual_seed(0)
    model = Stack(9)
    shard(model, world_size, "default")
    opt = _adam_steps(model, rank, world_size)
    perparam.checkpoint.save(path, model, opt)
    return _full_state(model, opt)


def load_into(rank: int, world_size: int, path: str, layout: str) -> dict:
    torch.manual_seed(5)  # other values than the saved ones
    model = Stack(9)
    if layout == "tp":
        shard(model, world_size, "default")
    elif world_size:  # plain data parallelism over every rank
        perparam.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():  # materialise the optimizer state the checkpoint fills
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad()
    perparam.checkpoint.load(path, model, opt)
    return _full_state(model, opt)


def test_an_uneven_tp_checkpoint_loads_on_another_tp_mesh_on_plain_dp_and_on_one_rank(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_distributed(save_uneven, 4, path)[0]
    for world_size, layout in ((4, "tp"), (2, "tp"), (4, "dp"), (1, "dp")):
        got = run_distributed(load_into, world_size, path, layout)[0]
        for key, value in saved.items():
            assert torch.equal(got[key], value), (layout, world_size, key)


class Mlp(nn.Module):
    """FSDP2's test ``MLP(dim, dim_multiplier)``: relu(out_proj(relu(in_proj(x))))."""

    def __init__(self, dim: int, dim_multiplier: int = 4) -> None:
        super().__init__()
        self.in_proj, self.out_proj = (nn.Linear(dim, dim_multiplier * dim),
                                       nn.Linear(dim_multiplier * dim, dim))

    def forward(self, x):
        return F.relu(self.out_proj(F.relu(self.in_proj(x))))


def fsdp2_sharded_parameters(rank: int, world_size: int) -> list:
    """FSDP2's ``test_shard_dtensor_parameters``: MLP(9, dim_multiplier=3) (27 hidden rows over tp = 2)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = Mlp(9, dim_multiplier=3)
    orig = {n: p.detach().clone() for n, p in model.named_parameters()}
    parallelize_module(model, mesh["tp"], {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()})
    perparam.fully_shard(model, mesh=mesh["dp"])
    wrong = []
    for name, p in model.named_parameters():
        want = ((_StridedShard(0, split_factor=2), Shard(0)) if "in_proj" in name
                else (Shard(0), Shard(1)) if name == "out_proj.weight" else (Shard(0), Replicate()))
        checks = {"DTensor": isinstance(p, DTensor), "mesh": p.device_mesh == mesh,
                  "size": p.size() == orig[name].size(), "stride": p.stride() == orig[name].stride(),
                  "placements": tuple(p._spec.placements) == want,
                  "values": torch.equal(p.full_tensor(), orig[name])}
        wrong += [(name, what) for what, ok in checks.items() if not ok]
    return wrong


def test_fsdp2_shard_dtensor_parameters_uneven_tp_gives_fsdp2s_mesh_size_stride_and_placements():
    # FSDP2's test_fully_shard_init.py::TestFullyShardShardedParameterDTensor::test_shard_dtensor_parameters
    for wrong in run_distributed(fsdp2_sharded_parameters, 4):
        assert wrong == [], wrong


def mlp_stack(mlp_dim: int) -> nn.Sequential:
    """FSDP2's ``MLPStack``: multiplier 3 (9 hidden rows at mlp_dim 3: uneven over tp = 2), 4, 3."""
    return nn.Sequential(Mlp(mlp_dim, 3), Mlp(mlp_dim), Mlp(mlp_dim, 3))


def nd_mesh_losses(rank: int, world_size: int, mlp_dim: int, reshard: bool, recompute: bool) -> dict:
    """FSDP2's ``test_2d_mlp_with_nd_mesh``: each dp rank's loss per step, Adam, 10 steps, zero_grad
    alternately to None; the reference (world_size 0) averages the dp ranks' gradients in one process."""
    torch.manual_seed(42)
    model = mlp_stack(mlp_dim)
    if world_size:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        plan = {}
        for i in range(3):  # use_local_output=False keeps the uneven activations DTensors
            plan[f"{i}.in_proj"] = ColwiseParallel(use_local_output=False)
            plan[f"{i}.out_proj"] = RowwiseParallel(use_local_output=False)
        plan["2.out_proj"] = RowwiseParallel()
        parallelize_module(model, mesh["tp"], plan)
        for block in model:
            if recompute:
                from torch.distributed._composable import checkpoint
                checkpoint(block)
            perparam.fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard)
        perparam.fully_shard(model, mesh=mesh["dp"], reshard_after_forward=reshard)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    dps = [rank // 2] if world_size else [0, 1]
    gens = {d: torch.Generator().manual_seed(42 + d + 1) for d in dps}
    losses = {d: [] for d in dps}
    for step in range(10):
        opt.zero_grad(set_to_none=step % 2 == 0)
        total = 0
        for d in dps:
            loss = model(torch.randn((8, mlp_dim), generator=gens[d])).sum()
            losses[d].append(loss.item())
            total = total + loss
        (total / len(dps)).backward()
        opt.step()
    return {"losses": losses,
            "meshes": {p.device_mesh.mesh_dim_names for p in model.parameters() if isinstance(p, DTensor)}}


@pytest.mark.parametrize("reshard,recompute", [(True, False), (False, True)])
@pytest.mark.parametrize("mlp_dim", [3, 17])
def test_fsdp2_2d_mlp_with_nd_mesh_uneven_tp_losses_match_fsdp2s_reference(mlp_dim, reshard, recompute):
    # FSDP2's test_fully_shard_training.py::TestFullyShardNDTraining::test_2d_mlp_with_nd_mesh (mlp_dim 3:
    # 9 hidden rows over tp = 2; 17: 51)
    want = one_process(nd_mesh_losses, mlp_dim, reshard, recompute)["losses"]
    for rank, out in enumerate(run_distributed(nd_mesh_losses, 4, mlp_dim, reshard, recompute)):
        (d, got), = out["losses"].items()
        assert out["meshes"] == {("dp", "tp")}
        assert max(abs(a - b)
                   for a, b in zip(got, want[d])) <= TOL * max(1.0, max(map(abs, want[d]))), (rank, got)


def full_state_round_trip(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = Stack(9)
    want = {n: p.detach().clone() for n, p in model.state_dict().items()}
    shard(model, world_size, "default")
    gathered = perparam.checkpoint.full_state_dict(model)
    torch.manual_seed(5)
    other = Stack(9)
    shard(other, world_size, "default")
    perparam.checkpoint.load_full_state_dict(other, gathered if rank == 0 else None)
    loaded = {n: p.full_tensor() for n, p in other.state_dict().items()}
    return {"gathered": None if gathered is None
            else all(torch.equal(gathered[n], v) for n, v in want.items()),
            "loaded": all(torch.equal(loaded[n], v) for n, v in want.items())}


def test_an_uneven_tp_model_gives_and_takes_its_unsharded_state_dict():
    got = run_distributed(full_state_round_trip, 4)
    assert got[0]["gathered"] is True and all(g["loaded"] for g in got), got
