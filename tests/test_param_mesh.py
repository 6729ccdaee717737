"""A parameter's mesh as part of its policy (``ParamPolicy(mesh=...)``): one ``fully_shard`` call over a
MoE block whose dense parameters are on the 2-rank mesh and whose expert is on a 1-rank expert-data-parallel
mesh (EP = 2 on 2 ranks) trains as one process with the default divisor (the call's mesh size), issues
one all-gather per mesh and one reduce-scatter per (mesh, reduce dtype), clips by the true global norm,
checkpoints bit-exactly and is planned to the byte; bad meshes are refused naming the parameter."""

from __future__ import annotations

import functools
import tempfile
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import perparam
from perparam import CommCounter, ParamPolicy
from perparam.memory.measure import model_state_bytes
from perparam.memory.plan import plan_module
from tests import moe_helpers as moe
from tests.distributed import run_distributed

OPTIMIZERS = ("adamw", "sgd")


class Outer(nn.Module):
    """A root without parameters of its own around a block."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        return self.block(x, route)


def moe_one_call(rank: int, world_size: int, folder: str) -> dict:
    """EP = 2 on 2 ranks: ``pre``/``post`` on the 2-rank mesh, this rank's expert on its 1-rank edp mesh,
    one ``fully_shard`` call, no divide factor. Per optimizer: gradients, parameters, collectives per step;
    the clipped norm; planned against live bytes."""
    dp = init_device_mesh("cpu", (2,))
    edp = init_device_mesh("cpu", (2, 1), mesh_dim_names=("ep", "edp"))["edp"]
    policy = {"expert.*": ParamPolicy(mesh=edp)}
    out = {}
    for name in OPTIMIZERS:
        model = moe.expert_parallel_model(rank)
        perparam.fully_shard(model, mesh=dp, param_policy=policy)
        opt = moe.make_optimizer(model.parameters(), name)
        norm = []

        def clip(model=model, norm=norm):  # the first step's global norm (max 1e6: nothing is clipped)
            norm.append(float(perparam.clip_grad_norm_(model.parameters(), 1e6)))

        def live(model=model, opt=opt):  # shards, their .grads (padded, plus used flags) and AdamW state
            out["live"] = model_state_bytes(model, opt).as_dict()
            out["live"]["steps"] = sum(1 for s in opt.state.values() if "step" in s)

        out[name] = moe.train(model, opt, rank, rank, after_first_backward=clip,
                              after_step=live if name == "adamw" else None)
        out[name]["norm"] = norm[0]
    # the planner: the same bytes as the live shards
    with torch.device("meta"):
        meta = moe.expert_parallel_model(rank)
    plan = plan_module(meta, 2, dtype=None, optim_bytes=8, param_policy=policy)
    want = plan.rank(rank)
    out["planned"] = {"params": want.params, "grads": want.grads, "optimizer": want.optimizer}
    out["errors"] = bad_meshes(rank, dp)
    out["full_state"] = full_state_refusals(rank, dp, edp)
    out["checkpoint_exact"] = checkpoint_round_trip(rank, dp, edp, folder)
    # two reduce dtypes on each mesh: one reduce-scatter per (mesh, reduce dtype)
    bf16 = torch.bfloat16
    model = moe.expert_parallel_model(rank)
    perparam.fully_shard(model, mesh=dp,
                         param_policy={"expert.bias": ParamPolicy(mesh=edp, reduce_dtype=bf16),
                                       "expert.weight": ParamPolicy(mesh=edp),
                                       "pre.bias": ParamPolicy(reduce_dtype=bf16)})
    x, y, route = moe.batches(2)[0]
    mine = slice(rank * moe.TOKENS, (rank + 1) * moe.TOKENS)
    with CommCounter() as comm:
        F.mse_loss(model(x[mine], route[mine]), y[mine]).backward()
    out["dtype_counts"] = Counter((r.kind, r.group_size, r.dtype) for r in comm.records)
    # the block below a root without parameters: it reshards after forward and gathers again in backward
    root = Outer(moe.expert_parallel_model(rank))
    perparam.fully_shard(root.block, mesh=dp, param_policy=policy)
    perparam.fully_shard(root, mesh=dp)
    for _ in range(2):
        with CommCounter() as comm:
            F.mse_loss(root(x[mine], route[mine]), y[mine]).backward()
    out["nested_counts"] = Counter((r.kind, r.group_size) for r in comm.records)
    return out


def moe_ep2_edp2(rank: int, world_size: int) -> dict:
    """4 ranks, (ep, edp) = (2, 2): ``pre``/``post`` on the 4-rank mesh, expert e sharded over the 2 edp
    ranks of ep coordinate e, tokens routed over the ep group; one call, no divide factor, SGD. Also the
    hpZ refusal (K = 4 is the smallest shard axis with an hpZ size)."""
    dp = init_device_mesh("cpu", (4,))
    ep_edp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "edp"))
    expert = ep_edp.get_coordinate()[0]
    model = moe.expert_parallel_model(expert, group=ep_edp.get_group("ep"))
    perparam.fully_shard(model, mesh=dp, param_policy={"expert.*": ParamPolicy(mesh=ep_edp["edp"])})
    out = moe.train(model, moe.make_optimizer(model.parameters(), "sgd"), rank, expert, ranks=4)
    try:
        perparam.fully_shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), mesh=dp,
                             reshard_after_forward=2,
                             param_policy={"1.weight": ParamPolicy(mesh=ep_edp["edp"])})
        hpz = "no error"
    except perparam.ShardingError as e:
        hpz = str(e)
    return {"params": out["params"], "counts": out["counts"], "hpz": hpz}


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's shards of the model and of the optimizer state (plain tensors: AdamW's ``step``)."""
    out = {n: t.to_local() for n, t in model.state_dict().items()}
    for p, state in opt.state.items():
        for key, t in state.items():
            out[f"{id(p)}.{key}"] = t.to_local() if isinstance(t, DTensor) else t
    return out


def checkpoint_round_trip(rank: int, dp: DeviceMesh, edp: DeviceMesh, folder: str) -> dict[str, bool]:
    """One AdamW step, ``perparam.checkpoint.save``, every shard and state zeroed, ``load``: each tensor of
    this rank equal to what was saved? (Each rank's expert is ``expert.*`` on its own mesh.)"""
    model = moe.expert_parallel_model(rank)
    perparam.fully_shard(model, mesh=dp, param_policy={"expert.*": ParamPolicy(mesh=edp)})
    opt = moe.make_optimizer(model.parameters(), "adamw")
    x, y, route = moe.batches(2)[0]
    mine = slice(rank * moe.TOKENS, (rank + 1) * moe.TOKENS)
    F.mse_loss(model(x[mine], route[mine]), y[mine]).backward()
    opt.step()
    saved = {k: t.clone() for k, t in _state(model, opt).items()}
    perparam.checkpoint.save(f"{folder}/ckpt", model, opt)
    with torch.no_grad():
        for t in _state(model, opt).values():
            t.zero_()
    perparam.checkpoint.load(f"{folder}/ckpt", model, opt)
    return {k: torch.equal(saved[k], t) for k, t in _state(model, opt).items()}


def full_state_refusals(rank: int, dp: DeviceMesh, edp: DeviceMesh) -> dict[str, object]:
    """``full_state_dict`` and ``load_full_state_dict`` of the one-call model (each rank's expert on its own
    mesh): the ``CheckpointError`` messages, or "no error"; whether this rank's expert kept its weights."""
    model = moe.expert_parallel_model(rank)
    perparam.fully_shard(model, mesh=dp, param_policy={"expert.*": ParamPolicy(mesh=edp)})
    before = model.expert.weight.to_local().clone()
    out: dict[str, object] = {}
    for name, call in (("full", lambda: perparam.checkpoint.full_state_dict(model)),
                       ("load", lambda: perparam.checkpoint.load_full_state_dict(
                           model, {k: torch.zeros(v.shape) for k, v in model.state_dict().items()}
                           if rank == 0 else None))):
        try:
            call()
            out[name] = "no error"
        except perparam.CheckpointError as e:
            out[name] = str(e)
    out["expert_kept"] = torch.equal(model.expert.weight.to_local(), before)
    return out


def bad_meshes(rank: int, dp: DeviceMesh) -> dict[str, str]:
    """Each bad ``ParamPolicy.mesh`` given to ``1.weight`` of a call on ``dp``: the ``ShardingError``
    message, or "no error"."""
    # only a DTensor's mesh
    tp = DeviceMesh("cpu", torch.arange(2), mesh_dim_names=("tp",), _init_backend=False)
    cases = {
        "device_type": DeviceMesh("meta", torch.tensor([rank]), _init_backend=False),
        "3d": DeviceMesh("cpu", torch.tensor([[[rank]]]), _init_backend=False),
        "not_this_rank": DeviceMesh("cpu", torch.tensor([1 - rank]), _init_backend=False),
        "tensor_parallel": DeviceMesh("cpu", torch.tensor([rank]), _init_backend=False),
        "not_a_mesh": "edp",
    }
    out = {}
    for case, bad in cases.items():
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        if case == "tensor_parallel":
            local = model[1].weight.detach()[rank:rank + 1]
            model[1].weight = nn.Parameter(DTensor.from_local(local, tp, [Shard(0)], run_check=False))
        try:
            perparam.fully_shard(model, mesh=dp, param_policy={"1.weight": ParamPolicy(mesh=bad)})
            out[case] = "no error"
        except perparam.ShardingError as e:
            out[case] = str(e)
        out[case + "_unchanged"] = not isinstance(model, perparam.ShardedModule)
    return out


@functools.cache
def _one_call_results() -> tuple[dict, ...]:
    with tempfile.TemporaryDirectory() as folder:
        return tuple(run_distributed(moe_one_call, 2, folder))


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_experts_on_their_own_mesh_in_one_call_match_one_process_with_the_default_divisor(optimizer):
    want = moe.reference(optimizer)
    for got in _one_call_results():
        moe.assert_matches(got[optimizer]["grads"], want["grads"])
        moe.assert_matches(got[optimizer]["params"], want["params"])


@pytest.mark.fast
def test_one_call_issues_one_all_gather_per_mesh_and_one_reduce_scatter_per_mesh_and_dtype():
    # the root keeps its gathered parameters into backward: per step one all-gather of the dense
    # parameters over 2 ranks and one of the expert over 1, one reduce-scatter each
    want = Counter({("all_gather", 2): 1, ("all_gather", 1): 1, ("reduce_scatter", 2): 1,
                    ("reduce_scatter", 1): 1})
    for got in _one_call_results():
        assert all(step == want for step in got["sgd"]["counts"]), got["sgd"]["counts"]


def test_one_reduce_scatter_per_mesh_and_reduce_dtype():
    f32, bf16 = torch.float32, torch.bfloat16
    want = Counter({("reduce_scatter", 2, f32): 1, ("reduce_scatter", 2, bf16): 1,
                    ("reduce_scatter", 1, f32): 1, ("reduce_scatter", 1, bf16): 1})
    for got in _one_call_results():
        reductions = Counter({k: n for k, n in got["dtype_counts"].items() if k[0] == "reduce_scatter"})
        assert reductions == want, got["dtype_counts"]
        assert sum(n for k, n in got["dtype_counts"].items() if k[0] == "all_gather") == 2  # one per mesh


def test_a_block_resharded_after_forward_gathers_once_per_mesh_in_forward_and_in_backward():
    want = Counter({("all_gather", 2): 2, ("all_gather", 1): 2, ("reduce_scatter", 2): 1,
                    ("reduce_scatter", 1): 1})
    for got in _one_call_results():
        assert got["nested_counts"] == want, got["nested_counts"]


def test_clip_grad_norm_of_the_one_call_model_is_the_true_norm_on_every_rank():
    grads = moe.reference("sgd")["grads"]
    true = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])).item()
    norms = [got["sgd"]["norm"] for got in _one_call_results()]
    assert norms[0] == norms[1]
    assert abs(norms[0] - true) < 1e-5, (norms, true)


def test_a_checkpoint_of_the_one_call_model_round_trips_bit_exact():
    # each rank's expert is 'expert.weight' on a mesh of its own: without perparam's per-mesh keys torch's
    # distributed checkpoint took them for one tensor and rank 0 loaded rank 1's expert
    for got in _one_call_results():
        assert len(got["checkpoint_exact"]) == 6 + 3 * 6 and all(got["checkpoint_exact"].values()), got


def test_the_plan_of_a_per_parameter_mesh_equals_the_live_bytes():
    for got in _one_call_results():  # the expert whole on each rank, the dense parameters halved
        want, live = got["planned"], got["live"]
        assert live["params"] == want["params"], (live, want)
        # + a 4-byte step each
        assert live["optimizer"] == want["optimizer"] + 4 * live["steps"], (live, want)
        assert live["grads"] >= want["grads"], (live, want)  # + padding and used flags


def test_four_ranks_with_experts_sharded_over_a_two_rank_edp_mesh_match_one_process():
    want = moe.reference("sgd", ranks=4)["params"]
    # per step: one all-gather and one reduce-scatter over the 4-rank mesh and over the 2-rank edp mesh
    counts = Counter({("all_gather", 4): 1, ("all_gather", 2): 1, ("reduce_scatter", 4): 1,
                      ("reduce_scatter", 2): 1})
    for got in run_distributed(moe_ep2_edp2, 4):
        moe.assert_matches(got["params"], want)
        assert all(step == counts for step in got["counts"]), got["counts"]
        assert ("'1.weight'" in got["hpz"]
                and "reshard_after_forward=2 (hpZ) is not supported" in got["hpz"]), got["hpz"]


@pytest.mark.fast
def test_full_state_dicts_of_experts_on_per_rank_meshes_are_refused_on_every_rank_naming_them():
    # one name, a different expert on each rank: gathered to rank 0 it kept rank 0's only, and loading
    # broadcast rank 0's expert over every rank's (silently, before this was refused)
    for got in _one_call_results():
        for name in ("full", "load"):
            message = got["full_state"][name]
            assert ("'expert.bias', 'expert.weight'" in message
                    and "perparam.checkpoint.save" in message), message
        assert got["full_state"]["expert_kept"]


@pytest.mark.parametrize("case,says", [
    ("device_type", "'meta' mesh but the call's mesh is 'cpu'"),
    ("3d", "1 axis (shard) or 2 (replicate, shard)"),
    ("not_this_rank", "does not hold this rank"),
    ("tensor_parallel", "tensor-parallel parameter on another data-parallel mesh"),
    ("not_a_mesh", "must be a torch.distributed.device_mesh.DeviceMesh"),
])
def test_a_bad_param_mesh_is_refused_at_fully_shard_naming_the_parameter(case, says):
    for got in _one_call_results():
        message = got["errors"][case]
        assert "'1.weight'" in message and says in message, message
        assert got["errors"][case + "_unchanged"]
