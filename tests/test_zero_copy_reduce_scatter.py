"""The zero-copy reduce-scatter (``paths/reduce_zero_copy.py``: per-parameter sends straight from the
unsharded gradients, no packing) reduces exactly what the packed all-to-all reduce-scatter reduces, bit for
bit, and trains alike: an empty shard, a 2/2/1 split, fp32 and bf16 parameters in one reduction with
``reduce_dtype`` fp32, gradients accumulated without sync then a synced backward, K = 2 and K = 3; and it is
still one reduce-scatter per group and reduce dtype, of the packed path's bytes. What a reduction keeps per
parameter set (``ParamGroup._reduce_plan``) follows the changes between steps: a parameter frozen and
unfrozen, ``to_empty()`` and a load, the setting switched, parameters (and a whole group) frozen between
micro-batches accumulated without sync."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import perparam
from perparam import CommCounter, ParamPolicy
from perparam.runtime.group import group_of
from perparam.sharding.layout import reduce_scatter_offsets
from tests.distributed import c10d_calls, run_distributed


def _model() -> nn.Sequential:
    # on 3 ranks: Linear(4, 2) leaves rank 2 without rows, Linear(2, 5) splits 2/2/1; the root's reduction
    # holds fp32 parameters, bf16-computed ones (bf16 gradients cast to fp32) and bf16-stored ones (the fp32
    # sum cast back to bf16 on the way into .grad), all with reduce_dtype fp32
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2), nn.Linear(2, 5), nn.Linear(5, 3), nn.Sequential(nn.Linear(3, 6)))
    model[2].to(torch.bfloat16)
    return model


def _shard(model: nn.Sequential) -> None:
    perparam.fully_shard(model[0])
    perparam.fully_shard(model[3])
    bf16_compute = ParamPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    bf16_stored = ParamPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    perparam.fully_shard(model, param_policy={"1.*": bf16_compute, "2.*": bf16_stored})


def _loss(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).sum()


def _train(rank: int, world_size: int, algorithm: str) -> dict:
    previous = perparam.configure(gloo_reduce_scatter=algorithm)
    try:
        model = _model()
        with warnings.catch_warnings():  # bf16-stored weights, on purpose
            warnings.simplefilter("ignore")
            _shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(1)
        batch = [torch.randn(2 * world_size, 4, generator=g)[2 * rank:2 * rank + 2] for _ in range(3)]
        with c10d_calls() as raw, CommCounter() as comm:
            opt.zero_grad(set_to_none=True)
            _loss(model, batch[0]).backward()
            first = [p.grad.to_local().clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad(set_to_none=True)
            model.set_requires_gradient_sync(False)  # accumulated without sync, reduced by the next backward
            _loss(model, batch[1]).backward()
            model.set_requires_gradient_sync(True)
            _loss(model, batch[2]).backward()
            opt.step()
        return {"first": first, "raw": dict(raw), "comm": [(r.kind, r.nbytes, r.dtype) for r in comm.records],
                "params": [p.to_local().clone() for p in model.parameters()],
                "grads": [p.grad.to_local().clone() for p in model.parameters()]}
    finally:
        perparam.configure(gloo_reduce_scatter=previous.gloo_reduce_scatter)


def _into_existing_grads(rank: int, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A second backward adds into the existing ``.grad``s (the fused division: ``alpha=1/D`` for the fp32
    parameters, divide-and-cast for the bf16-stored ones). Per root parameter: (its ``.grad``, what the
    unfused path gives: the sum the all-reduce hook saw divided, cast to the stored dtype, then added)."""
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _shard(model)
    sums = []
    model.set_all_reduce_hook(lambda reduced: sums.append(reduced.clone()))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2 * world_size, 4, generator=g)[2 * rank:2 * rank + 2]
    _loss(model, x).backward()
    root = [p for n, p in model.named_parameters() if n.startswith(("1.", "2."))]
    before = [p.grad.to_local().clone() for p in root]
    sums.clear()
    _loss(model, 2 * x).backward()
    (total,) = sums
    group = group_of(model)
    offsets, _ = reduce_scatter_offsets([sp.layout for sp in group.trainable()])
    out = []
    for p, old, offset in zip(root, before, offsets):
        piece = total.narrow(0, offset, old.numel()).view(old.shape)
        out.append((p.grad.to_local().clone(), old + (piece / world_size).to(old.dtype)))
    return out


def _changing(rank: int, world_size: int) -> dict:
    """Six SGD steps of one sharded model and of its unsharded copy on the global batch, with a change
    before each that a reduction's kept plan must follow: none, ``1.weight`` frozen, unfrozen again,
    ``to_empty()`` and a load of the state it had (new local shards), the packed reduce-scatter, zero-copy
    again; then a step of two micro-batches (sync off for the first) with ``1.weight`` and ``model[0]``
    frozen between them. The largest difference of the parameters, and the root group's plans kept."""
    previous = perparam.configure(gloo_reduce_scatter="zero_copy")
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 2), nn.Linear(2, 5), nn.Linear(5, 3))  # 3 ranks: rank 2 holds no
        reference = copy.deepcopy(model)                                          # row of Linear(4, 2)
        perparam.fully_shard(model[0])
        perparam.fully_shard(model)
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))

        def reload() -> None:
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            model.to_empty(device="cpu")
            model.load_state_dict(state)

        changes = [lambda: None,
                   lambda: [m[1].weight.requires_grad_(False) for m in (model, reference)],
                   lambda: [m[1].weight.requires_grad_(True) for m in (model, reference)],
                   reload,
                   lambda: perparam.configure(gloo_reduce_scatter="all_to_all"),
                   lambda: perparam.configure(gloo_reduce_scatter="zero_copy")]
        g = torch.Generator().manual_seed(3)
        for change in changes:
            change()
            x = torch.randn(2 * world_size, 4, generator=g)
            opt.zero_grad(set_to_none=True)
            ref_opt.zero_grad(set_to_none=True)
            model(x[2 * rank:2 * rank + 2]).pow(2).sum().backward()
            (reference(x).pow(2).sum() / world_size).backward()  # the mean over the ranks' sums
            opt.step()
            ref_opt.step()
        # two micro-batches, sync off for the first; between them 1.weight and all of model[0] (a group of its
        # own) are frozen: what they accumulated is still reduced and stepped, as one process steps the .grad
        # they hold (was: dropped at the sync, 6.7e-2 off after 3 AdamW steps on 3 ranks)
        x = torch.randn(2 * world_size, 4, generator=g)
        for i, sync in enumerate((False, True)):
            if i == 1:
                for m in (model, reference):
                    m[1].weight.requires_grad_(False)
                    m[0].requires_grad_(False)
            model.set_requires_gradient_sync(sync)
            model(x[2 * rank + i:2 * rank + i + 1]).pow(2).sum().backward()
            (reference(x[i::2]).pow(2).sum() / world_size).backward()  # micro-batch i: every rank's i-th row
        opt.step()
        ref_opt.step()
        diff = max((p.full_tensor() - r).abs().max().item()
                   for p, r in zip(model.parameters(), reference.parameters()))
        return {"diff": diff, "plans": len(group_of(model).own._reduce_plans)}
    finally:
        perparam.configure(gloo_reduce_scatter=previous.gloo_reduce_scatter)


def both_paths(rank: int, world_size: int) -> dict:
    out = {alg: _train(rank, world_size, alg) for alg in ("all_to_all", "zero_copy")}
    if world_size == 3:  # once is enough
        out["existing"] = _into_existing_grads(rank, world_size)
        out["changing"] = _changing(rank, world_size)
    return out


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.fast)])
def test_zero_copy_reduce_scatter_is_bitwise_the_packed_one_on_empty_uneven_mixed_dtype_and_no_sync(world):
    for rank, res in enumerate(run_distributed(both_paths, world)):
        packed, direct = res["all_to_all"], res["zero_copy"]
        # the gradients of the first backward, then the parameters and gradients after 2 AdamW steps
        for key in ("first", "params", "grads"):
            assert all(a.dtype == b.dtype and torch.equal(a, b)
                       for a, b in zip(packed[key], direct[key])), (rank, key)
        assert any(t.dtype == torch.bfloat16 for t in direct["grads"])
        if world == 3 and rank == 2:  # Linear(4, 2): no rows here
            assert direct["grads"][0].numel() == 0
        # the same collectives in CommCounter's terms (kind, bytes, dtype): one reduce-scatter per group
        assert packed["comm"] == direct["comm"]
        # at the c10d level: the packed path's reduce-scatters are all-to-alls, the zero-copy ones sends and
        # receives (3 groups, 2 synced backwards)
        assert direct["raw"]["all_to_all_single"] == packed["raw"]["all_to_all_single"] - 3 * 2
        assert direct["raw"]["send"] > packed["raw"]["send"] and direct["raw"]["recv"] > packed["raw"]["recv"]
        if world == 2:
            continue
        # the kept reduction plans follow freezing, to_empty and a load, and the setting: training stays
        # the unsharded model's (one plan per trainable set of the root: all of it, and without 1.weight)
        assert res["changing"]["diff"] < 1e-6 and res["changing"]["plans"] == 2, (rank, res["changing"])
        # the division fused into the accumulation: what dividing, casting and adding one by one gives
        assert {got.dtype for got, _ in res["existing"]} == {torch.float32, torch.bfloat16}
        assert all(torch.equal(got, want) for got, want in res["existing"]), rank


@pytest.mark.fast
def test_division_fused_into_the_cast_or_the_accumulation_is_bitwise_dividing_first():
    # what ShardedParam.accumulate_sharded_grad relies on: the cast in the division's pass (any divisor),
    # and for a power-of-two divisor ``add_(x, alpha=1/D)`` equal to dividing first, then adding
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4099, generator=g) * torch.logspace(-20, 20, 4099)  # 1e-20 .. 1e20: no subnormal x / D
    grad = torch.randn(4099, generator=g)
    for divisor in (2, 4, 8.0, 3, 6):
        cast = torch.div(x, divisor, out=torch.empty(x.shape, dtype=torch.bfloat16))
        assert torch.equal(cast, (x / divisor).to(torch.bfloat16))
        if divisor in (2, 4, 8.0):
            assert torch.equal(grad.clone().add_(x, alpha=1.0 / divisor), grad + x / divisor)
