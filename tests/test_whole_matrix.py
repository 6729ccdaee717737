"""Whole-matrix optimizers (``torch.optim.Muon``, ``torch.optim.Adafactor``) on sharded parameters: the
owner path (``ParamPolicy(update="owner")``, ``perparam.runtime.owner_step``) steps each matrix whole on one
rank, bit for bit the stock step; training matches one process; an unrouted whole-matrix optimizer is
refused at its first step."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import perparam
from perparam import CommCounter, ParamPolicy
from perparam.runtime import owner_step
from tests.distributed import one_process, run_distributed
from tests.models import full_params, make_batches
from tests.owner_cases import OWNER, compose, max_diff, recipe


def _matrices(rank: int, world_size: int, policy=OWNER) -> nn.Module:
    """Linear(8, 6), Linear(6, 5), Linear(5, 3) without bias (3 ranks: rows 2/2/2, 2/2/1, 1/1/1; 4 ranks:
    2/2/2/0, 2/2/1/0, 1/1/1/0): uneven and empty shards."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6, bias=False), nn.Linear(6, 5, bias=False),
                          nn.Linear(5, 3, bias=False))
    if world_size:
        for layer in model:
            perparam.fully_shard(layer, param_policy=policy)
        perparam.fully_shard(model, param_policy=policy)
    return model


def _bitwise(rank: int, world_size: int, bucket_bytes: int | None = None, muon: dict | None = None,
             add_later: bool = False, policy: ParamPolicy = OWNER) -> list[float]:
    """Each step: the sharded Muon against ``torch.optim.Muon`` on one device fed the gathered gradient
    (its own state carried along); returns the largest difference per step (0.0: bitwise), then the
    all-to-alls of the last step. ``bucket_bytes``: ``owner_step.BUCKET_BYTES`` for this run.
    ``add_later``: the optimizers start with the 6x5 and 3x5 matrices and gain the largest, 8x6, by
    ``add_param_group`` after the first step (a fresh plan would move the 6x5 matrix and its momentum)."""
    if bucket_bytes is not None:
        owner_step.BUCKET_BYTES = bucket_bytes
    muon = muon or {}
    model = _matrices(rank, world_size, policy)
    first = 1 if add_later else 0
    opt = torch.optim.Muon(list(model.parameters())[first:], lr=0.02, **muon)
    ref = [p.detach().full_tensor().clone() for p in model.parameters()]
    ref_opt = torch.optim.Muon(ref[first:], lr=0.02, **muon)
    g = torch.Generator().manual_seed(1)
    diffs = []
    for step in range(3):
        if add_later and step == 1:
            opt.add_param_group({"params": [model[0].weight]})
            ref_opt.add_param_group({"params": [ref[0]]})
        diff, comm = _step_beside_stock(model, opt, ref, ref_opt, g, rank, world_size)
        diffs.append(diff)
    return diffs + [comm.count("all_to_all")]


def _muon_beside_stock(rank: int, world_size: int, opt_cls=torch.optim.Muon, policy: ParamPolicy = OWNER):
    """``_matrices`` sharded under ``policy`` with ``opt_cls`` (lr 0.02) on it, its full parameters' copies
    with the stock Muon, and the batches' generator: what ``_step_beside_stock`` steps."""
    model = _matrices(rank, world_size, policy)
    ref = [p.detach().full_tensor().clone() for p in model.parameters()]
    return (model, opt_cls(model.parameters(), lr=0.02), ref, torch.optim.Muon(ref, lr=0.02),
            torch.Generator().manual_seed(1))


def _step_beside_stock(model, opt, ref, ref_opt, g, rank: int, world_size: int,
                       before_step=None) -> tuple[float, CommCounter]:
    """One step of the sharded ``opt`` and of ``ref_opt`` on one device fed the gathered gradient (this
    rank's 3 rows of a batch drawn from ``g``; ``before_step()`` run after backward): the largest parameter
    difference after it (0.0: bitwise) and the step's collectives."""
    x = torch.randn(3 * world_size, 8, generator=g)[3 * rank:3 * rank + 3]
    model(x).pow(2).sum().backward()
    if before_step is not None:
        before_step()
    for r, p in zip(ref, model.parameters()):
        r.grad = p.grad.full_tensor()
    with CommCounter() as comm:
        opt.step()
    ref_opt.step()
    opt.zero_grad()
    return max((p.full_tensor() - r).abs().max().item() for p, r in zip(model.parameters(), ref)), comm


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.fast), 3])
def test_the_owner_update_is_bitwise_torch_muon_on_the_gathered_gradient(world_size):
    for diffs in run_distributed(_bitwise, world_size):
        assert diffs == [0.0, 0.0, 0.0, 2]
    # buckets bounded at 400 bytes of gradient + parameter: [6x8 (384 B)], [5x6, 3x5 (360 B)], each
    # gathered while the one before is stepped: two all-to-alls per bucket, still bitwise
    for diffs in run_distributed(_bitwise, world_size, 400, {"nesterov": False, "weight_decay": 0.05}):
        assert diffs == [0.0, 0.0, 0.0, 4]
    # a parameter group added after a step: the owners holding momentum keep it, the new matrix fills in
    for diffs in run_distributed(_bitwise, world_size, None, None, True):
        assert diffs == [0.0, 0.0, 0.0, 2]
    # gradients reduce-scattered in bf16 or int8 blocks (qgZ), at stage 2: the step from them is still torch's
    for grad_quant in ("bf16", "int8"):
        policy = ParamPolicy(update="owner", grad_quant=grad_quant, zero_stage=2)
        for diffs in run_distributed(_bitwise, world_size, None, None, False, policy):
            assert diffs == [0.0, 0.0, 0.0, 2]


def _train(rank: int, world_size: int, kind: str, mesh_shape=None) -> dict:
    """TinyNet (Embedding(5, 6), LayerNorms, Linear(6, 13), Linear(13, 6), Linear(6, 2)) for 10 steps of
    the global batch 12; ``kind``: "muon" (Muon on the blocks' 2-D matrices, AdamW on the rest),
    "muon_match" (the same, nesterov=False, adjust_lr_fn="match_rms_adamw"), "adafactor" (all),
    "muon_owner" ("muon" with the gradients reduced to their owners: ``configure(owner_grad="owner")``)."""
    if kind == "muon_owner":
        previous = perparam.configure(owner_grad="owner")
        try:
            return _train(rank, world_size, "muon", mesh_shape)
        finally:
            perparam.configure(owner_grad=previous.owner_grad)
    if kind == "adafactor":
        model, _ = recipe(rank, world_size, OWNER, mesh_shape)
        opts = [torch.optim.Adafactor(model.parameters(), lr=0.01, weight_decay=0.01)]
    else:
        extra = {"nesterov": False, "adjust_lr_fn": "match_rms_adamw"} if kind == "muon_match" else {}
        model, opts = recipe(rank, world_size, None, mesh_shape, extra)
    k = world_size or 1
    comm = None
    for i, (idx, y) in enumerate(make_batches(10, 12)):
        if world_size:
            share = 12 // k
            idx, y = idx[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
        F.mse_loss(model(idx), y).backward()
        with CommCounter() as counter:
            for opt in opts:
                opt.step()
        if i == 1:
            comm = counter
        for opt in opts:
            opt.zero_grad()
    out = {"params": full_params(model)}
    if world_size:
        out["all_to_all"] = (comm.count("all_to_all"), comm.bytes("all_to_all"))
        out["state"] = sum(len(opts[0].state.get(p, {})) for p in opts[0].param_groups[0]["params"])
    return out


@pytest.mark.parametrize("kind", ["muon", "muon_match", "adafactor"])
def test_whole_matrix_optimizers_on_the_owner_path_train_like_one_process(kind):
    want = one_process(_train, kind)["params"]
    for world_size in (1, 2, 3, 4):
        results = run_distributed(_train, world_size, kind)
        for r in results:
            assert max_diff(r["params"], want) <= 1e-5, (kind, world_size, max_diff(r["params"], want))
        counts = {r["all_to_all"][0] for r in results}
        assert len(counts) == 1  # the same collectives on every rank


def test_muon_with_gradients_reduced_to_their_owners_trains_like_one_process():
    # K = 1 reduce-scatters as before (one rank: nothing to send to an owner)
    want = one_process(_train, "muon")["params"]
    for world_size in (2, 3, 4):
        for r in run_distributed(_train, world_size, "muon_owner"):
            assert max_diff(r["params"], want) <= 1e-5, (world_size, max_diff(r["params"], want))
    # HSDP 2x2: reduced to the owners of each replica's shard axis, the replicas' all-reduce after it
    results = run_distributed(_train, 4, "muon_owner", (2, 2))
    for r in results:
        assert max_diff(r["params"], want) <= 1e-5
    away = 4 * 78 * 4 - sum(_owner_rows_bytes(2))  # TinyNet's four 13 x 6 fp32 matrices over 2 shards
    # 2 (K-1)/K m n per replica group, its scatter's flags and its gather's witnesses of the 4 held gradients
    assert sum(r["all_to_all"][1] for r in results) == 2 * (2 * away + _flag_bytes(2) + _witness_bytes(2, 4))


@pytest.mark.fast
def test_muon_on_hsdp_2x2_trains_like_one_process():
    want = one_process(_train, "muon")["params"]
    for r in run_distributed(_train, 4, "muon", (2, 2)):
        assert max_diff(r["params"], want) <= 1e-5


def test_the_owner_exchange_is_one_all_to_all_each_way_per_bucket_with_3_k_minus_1_over_k_m_n_bytes():
    # Muon's 2 hidden matrices of 13 x 6 per block, 2 blocks: 4 x 78 fp32 elements in one bucket
    for world_size in (2, 4):
        results = run_distributed(_train, world_size, "muon")
        counts = [r["all_to_all"][0] for r in results]
        assert counts == [2] * world_size  # the gather and the scatter of the one bucket
        wire = sum(r["all_to_all"][1] for r in results)
        # exact: each non-owner sends its rows of gradient and parameter, each owner the others' rows back
        # with its flag (whether its step raised)
        assert wire == 3 * (4 * 78 * 4) - 3 * sum(_owner_rows_bytes(world_size)) + _flag_bytes(world_size)
        assert sum(r["state"] for r in results) == 4  # each matrix's momentum on its owner only


def _flag_bytes(world_size: int) -> int:
    """The scatter's flags of one fp32 bucket, summed over the ranks: one element from each rank to each
    other."""
    return world_size * (world_size - 1) * 4


def _witness_bytes(world_size: int, held: int) -> int:
    """The gather's witnesses of ``held`` fp32 gradients held on their owners (reduced to them), summed over
    the ranks: one element from each other rank to the owner, whether it saw the gradient zeroed in place."""
    return held * (world_size - 1) * 4


def _owner_rows_bytes(world_size: int) -> list[int]:
    """Bytes of the rows each matrix's owner holds itself (they never travel), in the plan's order."""
    from torch.distributed.tensor import Shard

    from perparam.sharding.layout import ShardLayout
    from perparam.sharding.owners import plan_shapes

    shapes = [(13, 6), (6, 13), (13, 6), (6, 13)]
    owners = plan_shapes(shapes, world_size).owners
    return [ShardLayout(s, torch.float32, world_size, Shard(0)).local_bytes(o)
            for s, o in zip(shapes, owners)]


def _refused(rank: int, world_size: int, name: str) -> str:
    model = _matrices(rank, world_size, policy=None)
    opt = {"Muon": lambda ps: torch.optim.Muon(ps, lr=0.02), "Adafactor": torch.optim.Adafactor,
           "_Mine": lambda ps: _Mine(ps, lr=0.1), "AdamW": torch.optim.AdamW}[name](model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    before = [p.to_local().clone() for p in model.parameters()]
    try:
        opt.step()
    except owner_step.WholeMatrixShardError as e:
        assert all(torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters()))
        return str(e)
    return "stepped"


class _Mine(torch.optim.SGD):
    perparam_whole_matrix = True


@pytest.mark.fast
def test_a_whole_matrix_optimizer_on_shards_without_the_owner_policy_is_refused_at_its_first_step():
    for name in ("Muon", "Adafactor", "_Mine"):
        for message in run_distributed(_refused, 2, name):
            assert message.startswith(f"{name} computes each parameter's update from the whole "
                                      "tensor"), message
            assert ("parameter '0.weight' (Linear, shape (6, 8))" in message
                    and "ParamPolicy(update='owner')" in message)
    # elementwise optimizers, and any optimizer on one rank, are untouched
    assert run_distributed(_refused, 2, "AdamW") == ["stepped"] * 2
    assert run_distributed(_refused, 1, "Muon") == ["stepped"]


@pytest.mark.parametrize("case", ["accumulate", "clip", "stages", "frozen", "dtensor_adamw", "adamw_owner"])
def test_the_owner_path_composes_and_trains_like_one_process(case):
    want = one_process(compose, case)
    for world_size in (2, 3):
        results = run_distributed(compose, world_size, case)
        for r in results:
            assert max_diff(r["params"], want["params"]) <= 1e-5, (case, world_size)
            assert r["ns_calls"] == r["ns_calls"][:1] * 4
        # Newton-Schulz once per matrix per optimizer step (never per micro-batch), on its owner only
        assert sum(r["ns_calls"][0] for r in results) == 4 == want["ns_calls"][0]


def _steps(model, opts, rank: int, world_size: int, first: int, last: int) -> None:
    k = world_size or 1
    for idx, y in make_batches(6, 12)[first:last]:
        share = 12 // k
        F.mse_loss(model(idx[rank * share:(rank + 1) * share]), y[rank * share:(rank + 1) * share]).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()


def _owned_state(model, opt) -> dict:
    """name -> state key -> tensor this rank holds whole (an owner's), or the full tensor of a DTensor."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone()
                           for k, v in state.items() if isinstance(v, torch.Tensor)}
            for p, state in opt.state.items() if state}


def _uninterrupted(rank: int, world_size: int) -> dict:
    model, opts = recipe(rank, world_size)
    _steps(model, opts, rank, world_size, 0, 6)
    return full_params(model)


def _save(rank: int, world_size: int, path: str) -> dict:
    model, opts = recipe(rank, world_size)
    _steps(model, opts, rank, world_size, 0, 3)
    perparam.checkpoint.save(path, model, opts)  # one checkpoint, both optimizers' state
    return {"muon": _owned_state(model, opts[0]), "adamw": _owned_state(model, opts[1])}


def _resume(rank: int, world_size: int, path: str) -> dict:
    model, opts = recipe(rank, world_size)
    perparam.checkpoint.load(path, model, opts)
    loaded = {"muon": _owned_state(model, opts[0]), "adamw": _owned_state(model, opts[1])}
    _steps(model, opts, rank, world_size, 3, 6)
    return {"loaded": loaded, "params": full_params(model)}


def _merged(results: list[dict], key: str) -> dict:
    out: dict = {}
    for r in results:
        for name, state in r[key].items():
            out.setdefault(name, {}).update(state)
    return out


def test_a_checkpoint_of_muon_and_adamw_state_round_trips_bit_exact_and_loads_on_another_world_size(tmp_path):
    want = one_process(_uninterrupted)
    for saved_k, loaded_k in ((2, 2), (4, 3)):
        path = str(tmp_path / f"ckpt-{saved_k}")
        saved = run_distributed(_save, saved_k, path)
        resumed = run_distributed(_resume, loaded_k, path)
        for which in ("muon", "adamw"):
            before = _merged(saved, which)
            after = _merged([r["loaded"] for r in resumed], which)
            assert before.keys() == after.keys() and before  # owners re-planned: each state on one owner
            for name in before:
                for k in before[name]:
                    assert torch.equal(before[name][k], after[name][k]), (saved_k, loaded_k, which, name, k)
        momentum_holders = [len(r["loaded"]["muon"]) for r in resumed]
        assert sum(momentum_holders) == 4  # four matrices' momentum, each on its owner only
        for r in resumed:
            assert max_diff(r["params"], want) <= 1e-5, (saved_k, loaded_k)


def _adafactor_save(rank: int, world_size: int, path: str, load: bool) -> dict:
    """_matrices under the owner policy and Adafactor (state: a step count and row/column factors, none
    of the parameter's shape): 2 steps then save, or load; returns the state this rank holds."""
    model = _matrices(rank, world_size)
    opt = torch.optim.Adafactor(model.parameters(), lr=0.01)
    if load:
        perparam.checkpoint.load(path, model, opt)
    else:
        for _ in range(2):
            model(torch.randn(2, 8, generator=torch.Generator().manual_seed(rank))).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        perparam.checkpoint.save(path, model, opt)
    return _owned_state(model, opt)


def test_a_checkpoint_of_adafactor_owner_state_loads_bit_exact_on_another_world_size(tmp_path):
    path = str(tmp_path / "ada")
    before = _merged([{"s": r} for r in run_distributed(_adafactor_save, 2, path, False)], "s")
    loaded = run_distributed(_adafactor_save, 3, path, True)
    after = _merged([{"s": r} for r in loaded], "s")
    assert sorted(before) == sorted(after) == ["0.weight", "1.weight", "2.weight"]
    assert sum(len(r) for r in loaded) == 3  # each parameter's factors on its new owner only
    for name in before:
        assert sorted(before[name]) == ["col_var", "row_var", "step"]
        for k in before[name]:
            assert torch.equal(before[name][k], after[name][k])


def _closure(rank: int, world_size: int) -> str:
    model = _matrices(rank, world_size)
    opt = torch.optim.Muon(model.parameters(), lr=0.02)
    model(torch.randn(2, 8)).sum().backward()

    def closure():
        return model(torch.randn(2, 8)).sum()

    try:
        opt.step(closure)
    except owner_step.OwnerStepError as e:
        return str(e)
    return "stepped"


def test_a_step_with_a_closure_on_owner_parameters_is_refused():
    for message in run_distributed(_closure, 2):
        assert message.startswith("Muon.step(closure) computes gradients inside the step"), message


def _experts(rank: int, world_size: int) -> list:
    """Three experts under the owner policy in one group: rank 0 uses the first, the others the second,
    no rank the third (its gradient stays None everywhere). Debug mode checks that every rank issues the
    same collectives; returns the difference from torch.optim.Muon on the gathered gradients."""
    perparam.set_debug(True)
    torch.manual_seed(0)
    experts = [nn.Linear(3, 4, bias=False), nn.Linear(3, 5, bias=False), nn.Linear(3, 2, bias=False)]
    perparam.fully_shard(experts, param_policy=OWNER)
    params = [e.weight for e in experts]
    opt = torch.optim.Muon(params, lr=0.02)
    ref = [p.detach().full_tensor().clone() for p in params]
    ref_opt = torch.optim.Muon(ref, lr=0.02)
    experts[0 if rank == 0 else 1](torch.ones(2, 3) * (rank + 1)).pow(2).sum().backward()
    for r, p in zip(ref, params):
        r.grad = None if p.grad is None else p.grad.full_tensor()
    with CommCounter() as comm:
        opt.step()
    ref_opt.step()
    return [max((p.full_tensor() - r).abs().max().item() for p, r in zip(params, ref)),
            params[2].grad is None, comm.count("all_to_all"), sum(1 for s in opt.state.values() if s)]


def test_ranks_using_different_experts_take_the_same_owner_exchange_and_the_stock_step():
    results = run_distributed(_experts, 3)
    assert [r[:3] for r in results] == [[0.0, True, 2]] * 3  # the unused expert left out on every rank
    assert sum(r[3] for r in results) == 2  # two experts stepped, each on its owner only


def _expert_mesh(rank: int, world_size: int) -> list:
    """A dense Linear(6, 5) on the 4-rank mesh and an expert Linear(6, 7) on its own 2-rank mesh
    (``ParamPolicy(mesh=edp)``), both under the owner policy in one call: one bucket per mesh, each
    matrix stepped by an owner of its own mesh, bitwise torch.optim.Muon on the gathered gradient."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    dp = init_device_mesh("cpu", (4,))
    edp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "edp"))["edp"]
    model = nn.Sequential(nn.Linear(6, 5, bias=False), nn.Linear(5, 7, bias=False))
    perparam.fully_shard(model, mesh=dp, param_policy={"0.weight": OWNER,
                                                       "1.weight": ParamPolicy(update="owner", mesh=edp)})
    params = list(model.parameters())
    opt = torch.optim.Muon(params, lr=0.02)
    ref = [p.detach().full_tensor().clone() for p in params]
    ref_opt = torch.optim.Muon(ref, lr=0.02)
    diffs = []
    for step in range(2):
        model(torch.randn(2, 6,
                          generator=torch.Generator().manual_seed(rank + 10 * step))).pow(2).sum().backward()
        for r, p in zip(ref, params):
            r.grad = p.grad.full_tensor()
        with CommCounter() as comm:
            opt.step()
        ref_opt.step()
        opt.zero_grad()
        diffs.append(max((p.full_tensor() - r).abs().max().item() for p, r in zip(params, ref)))
    return diffs + [comm.count("all_to_all"), sorted({r.group_size for r in comm.records})]


def test_an_expert_on_its_own_mesh_is_stepped_by_an_owner_of_that_mesh():
    for r in run_distributed(_expert_mesh, 4):
        assert r == [0.0, 0.0, 4, [2, 4]]  # one bucket per mesh, two all-to-alls each


def _muon_then_adamw(rank: int, world_size: int, path: str, phase: str) -> dict:
    """``phase`` "muon": ``_matrices`` under the owner policy, 3 Muon steps (each rank 3 rows of a global
    batch of ``3 * world_size``), then ``perparam.checkpoint.save`` of the model and Muon's state.
    ``phase`` "adamw": the same model sharded plain ``Shard(0)`` (no owner), the checkpoint's model loaded,
    then 3 AdamW steps on the same kind of global batch (``world_size == 0``: one process, the first loaded
    from the full tensors the save returned). Returns the full parameters after the load and at the end."""
    g = torch.Generator().manual_seed(7)
    if phase == "muon":
        model = _matrices(rank, world_size)
        opt = torch.optim.Muon(model.parameters(), lr=0.02)
        for _ in range(3):
            x = torch.randn(3 * world_size, 8, generator=g)[3 * rank:3 * rank + 3]
            model(x).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        perparam.checkpoint.save(path, model, opt)
        return {"saved": full_params(model)}
    k = max(world_size, 1)
    model = _matrices(rank, world_size, policy=None)
    if world_size:
        perparam.checkpoint.load(path, model)
    else:
        with torch.no_grad():
            for p, want in zip(model.parameters(), torch.load(path + ".ref").values()):
                p.copy_(want)
    loaded = full_params(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    for _ in range(3):
        x = torch.randn(3 * 2, 8, generator=g)
        x = x[3 * rank * 2 // k:3 * (rank + 1) * 2 // k] if world_size else x
        (model(x).pow(2).sum() * (k if world_size else 1)).backward()  # sum over the global batch
        opt.step()
        opt.zero_grad()
    return {"loaded": loaded, "final": full_params(model)}


def test_an_owner_checkpoint_loads_into_plain_shard0_parameters_and_fine_tunes_with_adamw_like_one_process(
        tmp_path):
    """Changing policy between runs (Muon on owners, then an AdamW fine-tune on plain ``Shard(0)``): the
    checkpoint's parameters come back bit-exact on 2 and 1 ranks, and the AdamW steps match one process."""
    path = str(tmp_path / "muon")
    saved = run_distributed(_muon_then_adamw, 2, path, "muon")[0]["saved"]
    torch.save(saved, path + ".ref")
    want = one_process(_muon_then_adamw, path, "adamw")
    for k in (2, 1):
        for r in run_distributed(_muon_then_adamw, k, path, "adamw"):
            for name, tensor in saved.items():
                assert torch.equal(r["loaded"][name], tensor), (k, name)
            assert max_diff(r["final"], want["final"]) <= 1e-5, k


def _held_bytes(shapes, world_size: int) -> int:
    """Bytes of the rows each matrix's owner holds itself (they never travel), summed over ``shapes``."""
    from torch.distributed.tensor import Shard

    from perparam.sharding.layout import ShardLayout
    from perparam.sharding.owners import plan_shapes

    owners = plan_shapes(shapes, world_size).owners
    return sum(ShardLayout(s, torch.float32, world_size, Shard(0)).local_bytes(o)
               for s, o in zip(shapes, owners))


def _stage1(rank: int, world_size: int) -> list:
    """``_matrices`` at stage 1 under the owner policy (gradients all-reduced whole onto every rank), 3 Muon
    steps against ``torch.optim.Muon`` fed the gathered gradient; the third clipped first
    (``perparam.clip_grad_norm_`` scales each rank's rows in place). Per step: the largest difference, the
    all-to-alls' bytes this rank sent and the all-reduces at the step."""
    model, opt, ref, ref_opt, g = _muon_beside_stock(rank, world_size,
                                                     policy=ParamPolicy(update="owner", zero_stage=1))
    out = []
    for step in range(3):
        clip = (lambda: perparam.clip_grad_norm_(list(model.parameters()), 0.1)) if step == 2 else None
        diff, comm = _step_beside_stock(model, opt, ref, ref_opt, g, rank, world_size, clip)
        out.append((diff, comm.bytes("all_to_all"), comm.count("all_reduce")))
    return out


def test_a_stage1_owner_gradient_whole_on_every_rank_does_not_travel_unless_a_rank_changed_its_rows():
    shapes = [(6, 8), (5, 6), (3, 5)]
    total = sum(m * n for m, n in shapes) * 4
    for world_size in (3,):  # rows 2/2/2, 2/2/1, 1/1/1
        results = run_distributed(_stage1, world_size)
        away = total - _held_bytes(shapes, world_size)  # the bytes of rows their owner does not hold
        for step in range(3):
            assert [r[step][0] for r in results] == [0.0] * world_size  # bitwise torch's Muon
            assert {r[step][2] for r in results} == {1}  # one all-reduce of the intact flags
        # parameter rows in and updated rows out: 2 (K-1)/K m n (3 (K-1)/K m n with the gradient rows)
        flags = _flag_bytes(world_size)
        assert [sum(r[step][1] for r in results) for step in range(3)] == [2 * away + flags, 2 * away + flags,
                                                                          3 * away + flags]


def _owner_grad(opt, p) -> torch.Tensor:
    """The reduced gradient of ``p`` as its owner holds it (whole there after a reduction to it), on every
    rank (a broadcast from the owner, outside perparam), or the gathered rows of a reduce-scattered one."""
    import torch.distributed as dist

    from perparam.runtime import owner_grads

    route = owner_step.routing(opt)
    e = route.by_id[id(p)] if route is not None else None
    if e is None or not owner_grads.at_owner(e.sp):
        return p.grad.full_tensor()
    whole = owner_grads.whole(e.sp)
    buf = whole.clone() if whole is not None else torch.empty(p.shape, dtype=p.dtype)
    dist.broadcast(buf, src=e.owner)
    return buf


def _to_owner(rank: int, world_size: int) -> list:
    """``_matrices`` under the owner policy with ``configure(owner_grad="owner")``, 4 Muon steps against
    ``torch.optim.Muon`` fed the owner's reduced gradient; the fourth clipped first
    (``perparam.clip_grad_norm_``, the reference clipped by the norm it returns). Per step: the largest
    difference, the step's all-to-all bytes as recorded, the same bytes as handed to gloo
    (``all_to_all_single``'s splits, this rank's own piece left out), and the backward's reductions."""
    import torch.distributed as dist

    wired = []
    original = dist.all_to_all_single

    def spy(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        splits = input_split_sizes or [input.numel() // group.size()] * group.size()
        wired.append((sum(splits) - splits[group.rank()]) * input.element_size())
        return original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    previous = perparam.configure(owner_grad="owner")
    dist.all_to_all_single = spy
    try:
        model, opt, ref, ref_opt, g = _muon_beside_stock(rank, world_size)
        out = []
        for step in range(4):
            x = torch.randn(3 * world_size, 8, generator=g)[3 * rank:3 * rank + 3]
            with CommCounter() as backward:
                model(x).pow(2).sum().backward()
            for r, p in zip(ref, model.parameters()):
                r.grad = _owner_grad(opt, p)
            if step == 3:
                norm = perparam.clip_grad_norm_(list(model.parameters()), 0.1)
                torch.nn.utils.clip_grads_with_norm_(ref, 0.1, norm)
            wired.clear()
            with CommCounter() as comm:
                opt.step()
            ref_opt.step()
            opt.zero_grad()
            out.append((max((p.full_tensor() - r).abs().max().item()
                            for p, r in zip(model.parameters(), ref)),
                        comm.bytes("all_to_all"), sum(wired), backward.by_kind()))
        return out
    finally:
        dist.all_to_all_single = original
        perparam.configure(owner_grad=previous.owner_grad)


@pytest.mark.fast
def test_a_gradient_reduced_to_its_owner_steps_bitwise_with_2_k_minus_1_over_k_m_n_bytes_at_the_step():
    shapes = [(6, 8), (5, 6), (3, 5)]
    total = sum(m * n for m, n in shapes) * 4
    for world_size in (4,):  # rows 2/2/2/0, 2/2/1/0, 1/1/1/0: uneven, and a rank with empty shards
        results = run_distributed(_to_owner, world_size)
        away = total - _held_bytes(shapes, world_size)
        for step in range(4):
            assert [r[step][0] for r in results] == [0.0] * world_size, step  # bitwise torch's Muon
            assert all(r[step][1] == r[step][2] for r in results)  # recorded = handed to gloo
        # the first step's gradients were reduce-scattered (no owner planned yet): 3 (K-1)/K m n; then 2, and
        # the gather's witnesses of the 3 gradients held on their owners
        flags, witnesses = _flag_bytes(world_size), _witness_bytes(world_size, 3)
        assert [sum(r[step][1] for r in results) for step in range(4)] == (
            [3 * away + flags] + [2 * away + flags + witnesses] * 3)
        assert [r[1][3] for r in results] == [{"all_gather": 6, "reduce_scatter": 3}] * world_size


def _dcp_full(rank: int, world_size: int) -> dict:
    """``_matrices`` with Muon on 0.weight and 1.weight (owners) and AdamW on 2.weight (plain ``Shard(0)``),
    2 steps; then ``get_optimizer_state_dict(..., full_state_dict=True)`` of both, set into a fresh model's
    optimizers with ``set_optimizer_state_dict(... full ...)``, got again, and one more step of both models
    on the same batch. Returns the full dict, whether every rank's owned state came back bit for bit (and
    only on the owners), whether the second full dict equals the first, and the parameters after the step."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True)
    policy = {"0.weight": OWNER, "1.weight": OWNER} if world_size else None

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 6, bias=False), nn.Linear(6, 5, bias=False),
                              nn.Linear(5, 3, bias=False))
        if world_size:
            perparam.fully_shard(model, param_policy=policy)
        params = list(model.parameters())
        return model, [torch.optim.Muon(params[:2], lr=0.02), torch.optim.AdamW(params[2:], lr=0.01)]

    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(9, 8, generator=g) for _ in range(3)]  # the global batch; 3 rows per rank at K = 3

    def step(model, opts, x):
        model(x[3 * rank:3 * rank + 3] if world_size else x).pow(2).mean().backward()  # ranks average
        for opt in opts:
            opt.step()
            opt.zero_grad()

    model, opts = build()
    for x in batches[:2]:
        step(model, opts, x)
    saved = get_optimizer_state_dict(model, opts, options=full)
    kept = copy.deepcopy(saved)  # as in a file: its plain tensors (AdamW's step) are the optimizer's own
    fresh, fresh_opts = build()
    set_optimizer_state_dict(fresh, fresh_opts, copy.deepcopy(saved), options=full)
    same_state = all(
        set(a.state.get(p, {})) == set(b.state.get(q, {}))
        and all(torch.equal(v.full_tensor() if isinstance(v, DTensor) else v,
                            b.state[q][key].full_tensor() if isinstance(v, DTensor) else b.state[q][key])
                for key, v in a.state.get(p, {}).items() if isinstance(v, torch.Tensor))
        for a, b in zip(opts, fresh_opts)
        for p, q in zip(a.param_groups[0]["params"], b.param_groups[0]["params"]))
    again = get_optimizer_state_dict(fresh, fresh_opts, options=full)
    def groups(d):  # DCP's round trip turns tuples (betas, ns_coefficients) into lists, for any optimizer
        return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in d["param_groups"]]

    same_dict = groups(saved) == groups(again) and all(
        torch.equal(saved["state"][n][key], again["state"][n][key]) for n in saved["state"]
        for key in saved["state"][n]
        if isinstance(saved["state"][n][key], torch.Tensor))
    fresh.load_state_dict(model.state_dict())
    step(model, opts, batches[2])
    step(fresh, fresh_opts, batches[2])
    return {"saved": kept, "same_state": same_state, "same_dict": same_dict,
            "params": full_params(model), "resumed": full_params(fresh)}


def test_full_optimizer_state_dicts_of_owner_parameters_round_trip_through_dcp_as_any_parameters():
    want = one_process(_dcp_full)
    for r in run_distributed(_dcp_full, 3):
        assert r["same_state"] and r["same_dict"]  # owners hold their state again, bit for bit
        assert r["saved"]["param_groups"] == want["saved"]["param_groups"]
        assert {n: sorted(s) for n, s in r["saved"]["state"].items()} == {
            n: sorted(s) for n, s in want["saved"]["state"].items()}  # the same full dict as one process'
        for n, state in want["saved"]["state"].items():
            for key, v in state.items():
                got = r["saved"]["state"][n][key]
                assert type(got) is type(v) and (got - v).abs().max().item() <= 1e-5, (n, key)
        # the loaded state steps
        assert all(torch.equal(r["params"][n], r["resumed"][n]) for n in r["params"])


class _RaisingOnRank0(torch.optim.Muon):
    """Muon whose step raises on rank 0 only (a user's check of a NaN, a dtype error, an OOM)."""

    def step(self, closure=None):
        if torch.distributed.get_rank() == 0 and self.defaults.get("raise_now"):
            raise FloatingPointError("NaN in the update")
        return super().step(closure)


def _raising_owner(rank: int, world_size: int) -> dict:
    """Step 1 raises on rank 0 (owner of the 8x6 matrix at K = 2); then one more step, not raising."""
    model = _matrices(rank, world_size)
    opt = _RaisingOnRank0(model.parameters(), lr=0.02)
    out = {}
    for step, raise_now in enumerate((False, True, False)):
        opt.defaults["raise_now"] = raise_now
        model(torch.randn(2, 8,
                          generator=torch.Generator().manual_seed(10 * rank + step))).pow(2).sum().backward()
        before = [p.to_local().clone() for p in model.parameters()]
        with CommCounter() as comm:
            try:
                opt.step()
            except owner_step.OwnerStepRaised as e:
                out.update(message=str(e), cause=repr(e.__cause__))
        out[f"changed{step}"] = [not torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters())]
        out[f"wire{step}"] = (comm.count("all_to_all"), comm.bytes("all_to_all"))
        opt.zero_grad()
    out["owners"] = [owner_step.routing(opt).by_id[id(p)].owner for p in model.parameters()]
    return out


def test_an_exception_in_the_owners_step_is_raised_on_every_rank_instead_of_hanging_its_peers():
    r0, r1 = run_distributed(_raising_owner, 2, timeout=20)
    assert r0["owners"] == [0, 1, 1]  # LPT: 8x6 alone on rank 0, 6x5 and 5x3 on rank 1
    for r in (r0, r1):
        assert r["message"].startswith("_RaisingOnRank0's step on whole tensors raised on rank 0 of its "
                                       "shard axis, the owner of parameters '0.weight' (Linear, shape (6, "
                                       "8)): FloatingPointError: NaN in the update. Every rank"), r["message"]
        assert r["changed0"] == r["changed2"] == [True] * 3  # before and after: every matrix stepped
        assert r["changed1"] == [False, True, True]  # the raising owner's matrix as before, rank 1's stepped
        # the same exchange whatever the owners computed: 2 all-to-alls, one flag element more per peer
        assert r["wire0"] == r["wire1"] == r["wire2"]
    assert r0["cause"] == "FloatingPointError('NaN in the update')" and r1["cause"] == "None"


def _state_dict_on_rank_0_only(rank: int, world_size: int, call: str) -> dict:
    """Muon on owner parameters over a mesh whose process group times out after 3 s; one step, then
    ``optimizer.<call>()`` on rank 0 alone (``if rank == 0: torch.save(opt.state_dict(), ...)``; a
    ``load_state_dict`` of the state dict taken on every rank), then a step and a ``state_dict()`` on every
    rank."""
    import time
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(dist.new_group(list(range(world_size)), timeout=timedelta(seconds=3)), "cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6, bias=False), nn.Linear(6, 5, bias=False))
    for layer in model:
        perparam.fully_shard(layer, mesh=mesh, param_policy=OWNER)
    perparam.fully_shard(model, mesh=mesh, param_policy=OWNER)
    opt = torch.optim.Muon(model.parameters(), lr=0.02)
    model(torch.randn(2, 8, generator=torch.Generator().manual_seed(rank))).pow(2).sum().backward()
    opt.step()
    saved = opt.state_dict()
    out = {}
    if rank == 0:
        start = time.monotonic()
        try:
            opt.state_dict() if call == "state_dict" else opt.load_state_dict(saved)
        except Exception as e:  # noqa: BLE001 - what it raises is the point
            out = {"error": type(e).__name__, "message": str(e)}
        out["seconds"] = time.monotonic() - start
    dist.barrier()  # rank 1 waits here (on the default group) meanwhile
    # the refused call left nothing behind: a step and a state_dict() on every rank work
    model(torch.randn(2, 8, generator=torch.Generator().manual_seed(rank))).pow(2).sum().backward()
    opt.step()
    out["keys"] = sorted(opt.state_dict()["state"])
    return out


@pytest.mark.parametrize("call", ["state_dict", "load_state_dict"])
def test_optimizer_state_dict_on_one_rank_with_owner_parameters_raises_naming_the_fix_instead_of_hanging(
        call):
    r0, r1 = run_distributed(_state_dict_on_rank_0_only, 2, call, timeout=60)
    assert r0["error"] == "CollectiveTimeoutError", r0
    assert f"call optimizer.{call}() on every rank" in r0["message"] and "[1]" in r0["message"], r0
    assert r0["keys"] == r1["keys"] == [0, 1]

def _raising_owner_two_buckets(rank: int, world_size: int) -> dict:
    """``_raising_owner`` with buckets of at most 400 bytes: [6x8] owned by rank 0, [6x5, 3x5] by rank 1."""
    owner_step.BUCKET_BYTES = 400
    return _raising_owner(rank, world_size)


def test_an_owner_raising_in_one_bucket_leaves_the_other_buckets_stepped_on_every_rank():
    r0, r1 = run_distributed(_raising_owner_two_buckets, 2, timeout=20)
    assert r0["owners"] == [0, 1, 1]
    for r in (r0, r1):
        assert r["message"].startswith("_RaisingOnRank0's step on whole tensors raised on rank 0"), (
            r["message"])
        assert r["changed0"] == r["changed2"] == [True] * 3
        # the second bucket's scatter landed, the first's rows not
        assert r["changed1"] == [False, True, True]
        assert r["wire0"] == r["wire1"] == r["wire2"] and r["wire1"][0] == 4  # two all-to-alls per bucket
    assert r0["cause"] == "FloatingPointError('NaN in the update')" and r1["cause"] == "None"


def _staged(rank: int, world_size: int) -> dict:
    """Three steps of ``_bitwise`` in buckets of at most 400 bytes, logging each bucket's step and each wait
    for a scatter, and the staging pool's allocations after each step."""
    from perparam.runtime import owner_exchange

    events, allocations = [], []
    stepped, scatter = owner_step._step_whole, owner_exchange.scatter

    def step_whole(*args):
        events.append("step")
        return stepped(*args)

    class Logged:
        def __init__(self, work):
            self.work = work

        def wait(self):
            events.append("scatter waited")
            return self.work.wait()

    def logged_scatter(*args):
        posted = scatter(*args)
        posted.work = Logged(posted.work)
        return posted

    owner_step._step_whole, owner_exchange.scatter = step_whole, logged_scatter
    owner_step.BUCKET_BYTES = 400
    model, opt, ref, ref_opt, g = _muon_beside_stock(rank, world_size)
    diffs = []
    for _ in range(3):
        events.append("step begins")
        diffs.append(_step_beside_stock(model, opt, ref, ref_opt, g, rank, world_size)[0])
        allocations.append(owner_step.routing(opt).staging.allocations)
    return {"diffs": diffs, "events": events, "allocations": allocations}


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_scatters_land_after_the_last_buckets_step_from_buffers_reused_across_steps(world_size):
    for r in run_distributed(_staged, world_size):
        assert r["diffs"] == [0.0, 0.0, 0.0]  # still the stock step, bit for bit
        for step in " ".join(r["events"]).split("step begins")[1:]:
            # each bucket's scatter in flight while the next bucket steps: no rank waits for a bucket's
            # slowest owner, only once for all of them after its last step
            assert step.split().count("scatter") == 2 and "step" not in step.split("scatter waited")[1]
        # every send and receive buffer of steps 2 and 3 is one the first step touched
        assert r["allocations"][0] > 0 and r["allocations"] == [r["allocations"][0]] * 3


class _CallsParentStep(torch.optim.Muon):
    """A user's Muon subclass whose step calls ``super().step()`` (a wrapper adding a check or a log)."""

    def step(self, closure=None):
        return super().step(closure)


def _subclass_step(rank: int, world_size: int) -> list:
    """Two steps of ``_CallsParentStep`` against the stock Muon (whose construction hooks ``Muon.step`` as
    well, so the subclass's ``super().step()`` runs perparam's hooks a second time, inside the step
    proper)."""
    model, opt, ref, ref_opt, g = _muon_beside_stock(rank, world_size, _CallsParentStep)
    out = []
    for _ in range(2):
        diff, comm = _step_beside_stock(model, opt, ref, ref_opt, g, rank, world_size)
        out.append((diff, comm.count("all_to_all"), [len(group["params"]) for group in opt.param_groups]))
    return out


def test_a_subclass_calling_its_parents_hooked_step_steps_each_owner_matrix_once():
    for r in run_distributed(_subclass_step, 2):
        assert r == [(0.0, 2, [3]), (0.0, 2, [3])]  # bitwise the stock step, one exchange, groups put back
