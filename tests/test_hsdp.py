"""HSDP on a 2D (replicate, shard) mesh: parity with 1D FSDP and a single process, the collectives per
group per step (all-gather and reduce-scatter over the shard axis, all-reduce over the replicate axis)
and their bytes against the layout's prediction."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import perparam
from mesh import ParallelDims
from perparam import CommCounter, ParamPolicy
from perparam.sharding.layout import ShardLayout
from tests.distributed import c10d_calls, run_distributed
from tests.models import TinyNet, comm_per_micro_batch, local_slice, make_batches

STEPS, GLOBAL_BATCH, TOL, MAX_NORM = 10, 12, 1e-5, 0.5
NAMES = ("dp_replicate", "dp_shard")


def _mesh(shape: tuple[int, ...], via_parallel_dims: bool = False):
    if via_parallel_dims == "unnamed":  # (replicate, shard) by position, as FSDP2 takes it
        return init_device_mesh("cpu", shape)
    if via_parallel_dims:  # the 2D dp sub-mesh of the named 3D world mesh (tp=1)
        return ParallelDims(dp_replicate=shape[0], dp_shard=shape[1]).build().dp_mesh
    if len(shape) == 1:
        return init_device_mesh("cpu", shape)
    return init_device_mesh("cpu", shape, mesh_dim_names=NAMES)


#: per-parameter placements: replicated norms, fc2 sharded on dim 1 (13 columns), the rest Shard(0)
MIXED = {"norm.*": ParamPolicy(placement=Replicate()), "fc2.weight": ParamPolicy(placement=Shard(1))}


def _shard(model: TinyNet, mesh, reshard_after_forward: bool | None = None, param_policy=None) -> None:
    for block in model.blocks:
        perparam.fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward,
                             param_policy=param_policy)
    perparam.fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)


def _want_placements(model: TinyNet, mesh, mixed: bool) -> dict:
    outer = () if mesh.ndim == 1 else (Replicate(),)
    want = {}
    for n, _ in model.named_parameters():
        inner = Shard(0)
        if mixed and ".norm." in n:
            inner = Replicate()
        elif mixed and n.endswith("fc2.weight"):
            inner = Shard(1)
        want[n] = (*outer, inner)
    return want


def _full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def train(rank: int, world_size: int, mesh_shape: tuple[int, ...] | None, via_parallel_dims: bool = False,
          mixed: bool = False) -> dict:
    """10 AdamW steps with gradient clipping; ``mesh_shape=None``: one process, the whole batch."""
    torch.manual_seed(0)
    model = TinyNet()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    out: dict = {"losses": [], "grads": [], "norms": []}
    if mesh_shape is not None:
        mesh = _mesh(mesh_shape, via_parallel_dims)
        _shard(model, mesh, param_policy=MIXED if mixed else None)
        want = _want_placements(model, mesh, mixed)
        out["placements"] = {n: p.placements for n, p in model.named_parameters()}
        assert out["placements"] == want
        for n, p in model.named_parameters():  # nothing lost or moved by sharding
            assert torch.equal(p.full_tensor(), original[n]), n
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in make_batches(STEPS, GLOBAL_BATCH):
        if mesh_shape is not None:
            x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if mesh_shape is not None:
            assert {n: p.grad.placements for n, p in model.named_parameters()} == want
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= world_size
        # clipping is active (norms ~1 > 0.5), so the trajectory depends on a correct global norm
        norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), MAX_NORM)
        out["losses"].append(loss.item())
        out["norms"].append(_full(norm).item())
        out["grads"].append({n: _full(p.grad) for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    out["params"] = {n: _full(p) for n, p in model.named_parameters()}
    if mesh_shape is not None and len(mesh_shape) == 2 and mesh.size(0) > 1:
        # the replicas of one shard hold the same bits (full_tensor() only gathers the shard axis)
        pg = mesh.get_group(0)  # the replicate axis (by position: the unnamed mesh too)
        for n, p in model.named_parameters():
            local = p.to_local().contiguous()
            copies = [torch.empty_like(local) for _ in range(pg.size())]
            dist.all_gather(copies, local, group=pg)
            assert all(torch.equal(c, local) for c in copies), n
    return out


def _assert_close(got: dict, want: dict, what: str) -> None:
    for key in ("losses", "norms"):
        diff = max(abs(a - b) for a, b in zip(got[key], want[key]))
        assert diff <= TOL, f"{what}: {key} differ by {diff}: {got[key]} vs {want[key]}"
    for step, (g, w) in enumerate(zip(got["grads"], want["grads"])):
        assert g.keys() == w.keys()
        for n in g:
            torch.testing.assert_close(g[n], w[n], atol=TOL, rtol=0, msg=f"{what}: grad {n} at step {step}")
    for n, p in got["params"].items():
        torch.testing.assert_close(p, want["params"][n], atol=TOL, rtol=0, msg=f"{what}: param {n}")


@pytest.fixture(scope="module")
def single_process() -> dict:
    want = train(0, 1, None)
    assert max(want["norms"]) > MAX_NORM  # the clipping is exercised
    return want


@pytest.mark.fast
def test_hsdp_2x2_equals_fsdp_and_single_process(single_process):
    hsdp = run_distributed(train, 4, (2, 2))
    fsdp = run_distributed(train, 4, (4,))
    for rank in range(4):
        _assert_close(hsdp[rank], single_process, f"HSDP 2x2 rank {rank}")
        _assert_close(fsdp[rank], single_process, f"FSDP 4 rank {rank}")
        _assert_close(hsdp[rank], fsdp[rank], f"HSDP vs FSDP rank {rank}")
    assert set(hsdp[0]["placements"].values()) == {(Replicate(), Shard(0))}
    assert set(fsdp[0]["placements"].values()) == {(Shard(0),)}


@pytest.mark.parametrize("mesh_shape", [(4, 1), (1, 4)])
def test_degenerate_axes_match_single_process(single_process, mesh_shape):
    # (4, 1): 4 replicas of an unsharded model (a shard axis of size 1); (1, 4): one replica
    for rank, got in enumerate(run_distributed(train, 4, mesh_shape)):
        _assert_close(got, single_process, f"mesh {mesh_shape} rank {rank}")


@pytest.mark.parametrize("mesh_shape", [(2, 2), (4,)])
def test_replicated_and_dim_1_placements_match_single_process(single_process, mesh_shape):
    for rank, got in enumerate(run_distributed(train, 4, mesh_shape, False, True)):
        _assert_close(got, single_process, f"mixed placements on mesh {mesh_shape} rank {rank}")


def test_dp_mesh_from_parallel_dims_matches(single_process):
    for rank, got in enumerate(run_distributed(train, 4, (2, 2), True)):
        _assert_close(got, single_process, f"ParallelDims(2, 2, 1).build().dp_mesh rank {rank}")


@pytest.mark.parametrize("mesh_shape", [(2, 2), (1, 3)])
def test_a_2d_mesh_without_axis_names_is_taken_as_replicate_shard_by_position(single_process, mesh_shape):
    # (1, 3): a shard axis of 3 ranks, empty shards of the 2-row head; (2, 2): 2 replicas of 2 shards
    for rank, got in enumerate(run_distributed(train, math.prod(mesh_shape), mesh_shape, "unnamed")):
        _assert_close(got, single_process, f"unnamed {mesh_shape} rank {rank}")
        assert set(got["placements"].values()) == {(Replicate(), Shard(0))}


# -- collectives ---------------------------------------------------------------------------------------


def _group_layouts(model: TinyNet, k: int) -> list[list[ShardLayout]]:
    """Each group's parameters in registration order (blocks first, then the root's embed and head)."""
    groups = [[ShardLayout(tuple(p.shape), p.dtype, k) for p in block.parameters()] for block in model.blocks]
    root = [p for n, p in model.named_parameters() if not n.startswith("blocks.")]
    return groups + [[ShardLayout(tuple(p.shape), p.dtype, k) for p in root]]


def count_step(rank: int, world_size: int, mesh_shape: tuple[int, int],
               reshard_after_forward: bool | None) -> dict:
    torch.manual_seed(0)
    model = TinyNet(n_blocks=3)
    mesh = _mesh(mesh_shape)
    layouts = _group_layouts(model, mesh.size(1))
    _shard(model, mesh, reshard_after_forward)
    steps = []
    for x, y in make_batches(2, 8):
        x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        with c10d_calls() as raw:  # at the c10d level too, so the counter cannot hide a collective
            with CommCounter() as fwd:
                loss = F.mse_loss(model(x), y)
            with CommCounter() as bwd:
                loss.backward()
        steps.append({"fwd": fwd.records, "bwd": bwd.records, "raw": dict(raw)})
    from perparam.comm.process_groups import reduce_group

    groups = {axis: (mesh.get_group(axis).group_name, mesh.get_group(axis).size()) for axis in NAMES}
    # gradient reductions run on their own process group over the same ranks (perparam.comm.process_groups)
    reduce = {axis: (reduce_group(mesh.get_group(axis)).group_name, mesh.get_group(axis).size())
              for axis in NAMES}
    from perparam.runtime.group import group_of

    # zero-copy: per parameter one send
    gathered = sum(len(group_of(m).own.gathered) for m in (model, *model.blocks))
    # zero-copy reduce-scatter: per trainable parameter and its used flags one send and one receive
    reduced = sum(len(group_of(m).trainable()) + 1 for m in (model, *model.blocks))
    return {"steps": steps, "groups": groups, "reduce_groups": reduce, "layouts": layouts,
            "gathered": gathered, "reduced": reduced}


def _by(records, *fields) -> Counter:
    return Counter(tuple(getattr(r, f) for f in fields) for r in records)


@pytest.mark.parametrize("mesh_shape", [(2, 2), (4, 1)])
def test_one_all_gather_reduce_scatter_and_all_reduce_per_group_per_step(mesh_shape):
    # 4 groups (3 blocks + root); parameters kept from forward to backward: one all-gather per group
    for res in run_distributed(count_step, 4, mesh_shape, False):
        (shard_name, k), (rep_name, r) = res["groups"]["dp_shard"], res["groups"]["dp_replicate"]
        (rs_name, _), (ar_name, _) = res["reduce_groups"]["dp_shard"], res["reduce_groups"]["dp_replicate"]
        assert (r, k) == mesh_shape and shard_name != rep_name
        for step in res["steps"]:
            assert _by(step["fwd"], "kind", "group_name", "group_size") == {("all_gather", shard_name, k): 4}
            assert _by(step["bwd"], "kind", "group_name", "group_size") == {
                ("reduce_scatter", rs_name, k): 4, ("all_reduce", ar_name, r): 4}
            # each group's all-reduce follows its reduce-scatter (reduce-scatters may run ahead: they are
            # left in flight while backward computes on)
            kinds = [r.kind for r in step["bwd"]]
            assert all(kinds[:i].count("all_reduce") <= kinds[:i].count("reduce_scatter") for i in range(9))
            # a size-1 axis issues no c10d call, but the replicate all-reduce always runs (on gloo, zero-copy,
            # an all-gather is per parameter one send and one receive, a reduce-scatter per parameter and
            # used flags; no empty shard at K = 2: perparam.comm.collectives)
            p2p = res["gathered"] + res["reduced"] if k > 1 else 0
            assert step["raw"] == {"all_gather_single": 0, "reduce_scatter_single": 0,
                                   "all_to_all_single": 0, "all_reduce": 4,
                                   "send": p2p, "recv": p2p}


def test_reshard_after_forward_gathers_again_in_backward_over_the_shard_axis():
    for res in run_distributed(count_step, 4, (2, 2), None):
        shard_name = res["groups"]["dp_shard"][0]
        rs_name, ar_name = res["reduce_groups"]["dp_shard"][0], res["reduce_groups"]["dp_replicate"][0]
        for step in res["steps"]:
            assert _by(step["fwd"], "kind", "group_name") == {("all_gather", shard_name): 4}
            # the root keeps its parameters for the backward that follows
            assert _by(step["bwd"], "kind", "group_name") == {
                ("all_gather", shard_name): 3, ("reduce_scatter", rs_name): 4, ("all_reduce", ar_name): 4}


@pytest.mark.parametrize("mesh_shape", [(2, 2), (1, 4), (4, 1)])
def test_bytes_match_the_layout(mesh_shape):
    """Per group: all-gather = K x slot bytes, reduce-scatter = K x sum(padded_local_numel) x 4, and the
    replicate all-reduce = sum(padded_local_numel) x 4 (padding included; fp32 throughout)."""
    for res in run_distributed(count_step, 4, mesh_shape, False):
        k = mesh_shape[1]
        expected = Counter()
        for lays in res["layouts"]:
            padded = sum(lay.padded_local_numel for lay in lays)
            slot_bytes = sum(lay.padded_local_numel * torch.float32.itemsize for lay in lays)
            expected["all_gather", k * slot_bytes] += 1
            flags = len(lays)  # one used flag per parameter in each rank's piece
            expected["reduce_scatter", k * (padded + flags) * 4] += 1
            expected["all_reduce", (padded + flags) * 4] += 1
        # the padding is real here: TinyNet's 13- and 5-row parameters do not split evenly
        assert k == 1 or any(lay.global_shape[0] % k for lays in res["layouts"] for lay in lays)
        for step in res["steps"]:
            assert _by(step["fwd"] + step["bwd"], "kind", "nbytes") == expected


def accumulate(rank: int, world_size: int) -> list[dict]:
    torch.manual_seed(0)
    model = TinyNet()
    mesh = _mesh((2, 2))
    _shard(model, mesh)
    return comm_per_micro_batch(model, rank, world_size)


def test_no_sync_micro_batches_neither_reduce_scatter_nor_all_reduce():
    for counts in run_distributed(accumulate, 4):
        assert [(c.get("reduce_scatter", 0), c.get("all_reduce", 0))
                for c in counts] == [(0, 0), (0, 0), (3, 3)]
