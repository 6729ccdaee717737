"""Ranks that use different parameters of one group (mixture-of-experts, conditional branches) issue the
same collectives and get the gradients an unsharded model averaged over ranks would; the debug mode
names a mismatched collective on every rank instead of hanging or reducing the wrong bytes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor import DTensor

import perparam
from tests.distributed import run_distributed


def _full(grad):
    return None if grad is None else (grad.full_tensor() if isinstance(grad, DTensor) else grad)


def _mismatch_message(call) -> str:
    """Run ``call()`` in debug mode; the ``CollectiveMismatchError`` message, or "no error"."""
    perparam.set_debug(True)
    try:
        call()
    except perparam.CollectiveMismatchError as e:
        return str(e)
    finally:
        perparam.set_debug(False)
    return "no error"


def _mean_over_ranks(per_rank: list[dict]) -> dict:
    """The reference gradient: each rank's unsharded gradient averaged over the ranks, a rank without
    one counting zero; parameters no rank had a gradient for are left out."""
    mean: dict = {}
    for grads in per_rank:
        for name, grad in grads.items():
            if grad is not None:
                mean[name] = mean.get(name, 0) + grad / len(per_rank)
    return mean


def two_experts(rank: int, world_size: int, rows1: int) -> list:
    torch.manual_seed(0)
    e0, e1 = nn.Linear(2, 2, bias=False), nn.Linear(2, rows1, bias=False)
    perparam.fully_shard([e0, e1])
    if rank == 0:
        e0(torch.full((1, 2), 1.0)).sum().backward()
    else:
        e1(torch.full((1, 2), 10.0)).sum().backward()
    return [_full(e0.weight.grad), _full(e1.weight.grad)]


# 3: the ranks' gradients differ in size too
@pytest.mark.parametrize("rows1", [2, pytest.param(3, marks=pytest.mark.fast)])
def test_ranks_using_different_parameters_get_the_averaged_gradient(rows1):
    for g0, g1 in run_distributed(two_experts, 2, rows1):
        torch.testing.assert_close(g0, torch.full((2, 2), 0.5), atol=0, rtol=0)
        torch.testing.assert_close(g1, torch.full((rows1, 2), 5.0), atol=0, rtol=0)


class Experts(nn.Module):
    """A mixture of experts without a router: which experts a rank runs is given per rank; the gate runs
    everywhere (every rank must run a backward: a rank without one would leave its peers' reduction)."""

    def __init__(self, n: int, rows: list[int]) -> None:
        super().__init__()
        self.gate = nn.Linear(3, 1)
        self.experts = nn.ModuleList(nn.Linear(3, r) for r in rows)
        self.n = n

    def forward(self, x: torch.Tensor, use: list[int], call_all: bool = False) -> torch.Tensor:
        total = self.gate(x).sum()
        outs = [e(x) for e in self.experts] if call_all else None  # every rank calls every expert
        for i in use:
            total = total + (outs[i] if call_all else self.experts[i](x)).square().sum()
        return total


def experts_step(rank: int, world_size: int, rows: list[int], uses: list[list[int]], xs: torch.Tensor,
                 per_expert: bool) -> dict:
    """One group for the model, or (``per_expert``) one group per expert, every rank calling every expert
    and using the outputs of its own; two steps, so the second runs with the first one's orders."""
    torch.manual_seed(0)
    model = Experts(len(rows), rows)
    if per_expert:
        for expert in model.experts:
            perparam.fully_shard(expert)
    perparam.fully_shard(model)
    perparam.set_debug(True)  # a mismatch would raise on every rank, not hang
    for _ in range(2):
        model.zero_grad()
        model(xs[rank:rank + 1], uses[rank], call_all=per_expert).backward()
    perparam.set_debug(False)
    return {"grads": {n: _full(p.grad) for n, p in model.named_parameters()}}


def _reference(rows, uses, xs) -> dict[str, torch.Tensor | None]:
    """Mean over ranks of each rank's gradient on an unsharded model; None where no rank used a parameter."""
    torch.manual_seed(0)
    model = Experts(len(rows), rows)
    sums: dict[str, torch.Tensor | None] = {n: None for n, _ in model.named_parameters()}
    for rank, use in enumerate(uses):
        model.zero_grad()
        model(xs[rank:rank + 1], use).backward()
        for n, p in model.named_parameters():
            if p.grad is not None:
                sums[n] = p.grad.clone() if sums[n] is None else sums[n] + p.grad
    return {n: None if g is None else g / len(uses) for n, g in sums.items()}


def experts_steps(rank: int, world_size: int, cases: list[tuple]) -> list[dict]:
    """``experts_step`` for each ``(rows, uses, xs, per_expert)`` of ``cases`` in turn, in one launch: each
    case builds, shards and trains its own model (one launch per case only repeated the process start)."""
    return [experts_step(rank, world_size, *case) for case in cases]


#: assignments checked per launch (hypothesis example): 4 examples x 2 = the 8 assignments of 8 launches
CASES_PER_LAUNCH = 2


@settings(max_examples=4, deadline=None, phases=[Phase.explicit, Phase.generate])
@example(data=None)
@given(st.data())
def test_any_assignment_of_experts_to_ranks_matches_the_unsharded_average(data):
    if data is None:  # the explicit example: 4 ranks, 3 experts, one unused everywhere, empty shards
        world, rows, uses = 4, [3, 1, 5], [[], [0], [0, 0], [2]]
        return _check_experts(world, [(rows, uses, True)])
    world = data.draw(st.integers(2, 4), label="world")
    cases = []
    for i in range(CASES_PER_LAUNCH):  # several assignments on the same ranks, each its own model
        n = data.draw(st.integers(1, 4), label=f"experts {i}")
        # < K: empty shards
        rows = data.draw(st.lists(st.integers(1, 5), min_size=n, max_size=n), label=f"rows {i}")
        uses = data.draw(st.lists(st.lists(st.integers(0, n - 1), max_size=3), min_size=world,
                                  max_size=world),
                         label=f"uses {i}")
        cases.append((rows, uses, data.draw(st.booleans(), label=f"per_expert {i}")))
    _check_experts(world, cases)


def _check_experts(world: int, cases: list[tuple[list[int], list[list[int]], bool]]) -> None:
    xs = torch.randn(world, 3, generator=torch.Generator().manual_seed(1))
    wants = [_reference(rows, uses, xs) for rows, uses, _ in cases]
    runs = [(rows, uses, xs, per_expert) for rows, uses, per_expert in cases]
    for per_case in run_distributed(experts_steps, world, runs, timeout=30):
        for want, out in zip(wants, per_case, strict=True):
            for name, grad in want.items():
                got = out["grads"][name]
                assert (got is None) == (grad is None), name  # unused everywhere: None on every rank
                if grad is not None:
                    torch.testing.assert_close(got, grad, atol=1e-6, rtol=1e-5, msg=name)


def mismatched(rank: int, world_size: int) -> str:
    torch.manual_seed(0)
    model = nn.Linear(4, 3 if rank == 0 else 5)  # the ranks disagree on the shape
    perparam.fully_shard(model)
    return _mismatch_message(lambda: model(torch.ones(1, 4)))


def test_debug_mode_names_a_mismatched_collective_on_every_rank():
    messages = run_distributed(mismatched, 2, timeout=60)
    for message in messages:
        assert "different collectives" in message
        assert "rank 0: all_gather" in message and "rank 1: all_gather" in message
        assert "weight" in message and "Linear" in message


def debug_mode_agrees(rank: int, world_size: int) -> int:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    perparam.fully_shard(model[0])
    perparam.fully_shard(model)
    perparam.set_debug(True)
    model(torch.ones(2, 4)).sum().backward()
    perparam.set_debug(False)
    dist.barrier()
    return 0


def test_debug_mode_passes_a_consistent_step():
    assert run_distributed(debug_mode_agrees, 3) == [0, 0, 0]


class Branches(nn.Module):
    """Every rank calls a, b and c; only some ranks add b's output into the loss (a conditional branch)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x, use_b: bool):
        h = torch.relu(self.a(x))
        hb = self.b(h)
        if use_b:
            h = h + hb
        return self.head(h + self.c(h))


def unused_output(rank: int, world_size: int, debug: bool) -> dict:
    torch.manual_seed(0)
    model = Branches()
    for m in (model.a, model.b, model.c):
        perparam.fully_shard(m)
    perparam.fully_shard(model)
    perparam.set_debug(debug)
    for _ in range(2):  # the second step: prefetch follows the first backward's order
        model.zero_grad()
        model(torch.ones(2, 4) * (rank + 1), use_b=rank == 0).sum().backward()
    perparam.set_debug(False)
    return {n: _full(p.grad) for n, p in model.named_parameters()}


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
def test_a_module_called_everywhere_whose_output_only_some_ranks_use(debug):
    torch.manual_seed(0)
    ref = Branches()
    per_rank = []
    for r in range(2):
        ref.zero_grad()
        ref(torch.ones(2, 4) * (r + 1), use_b=r == 0).sum().backward()
        per_rank.append({n: p.grad for n, p in ref.named_parameters()})  # rank 1 leaves b without one
    want = _mean_over_ranks(per_rank)
    for got in run_distributed(unused_output, 2, debug, timeout=30):
        for name, grad in want.items():
            torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=0, msg=name)


def same_shape_groups(rank: int, world_size: int) -> str:
    torch.manual_seed(0)
    experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
    for e in experts:
        perparam.fully_shard(e)  # two groups of equal classes and shapes
    # each rank calls another group: outside the contract
    return _mismatch_message(lambda: experts[rank](torch.ones(1, 4)))


def test_debug_mode_tells_apart_groups_of_equal_shape():
    for message in run_distributed(same_shape_groups, 2, timeout=30):
        assert "group #" in message and "rank 0" in message and "rank 1" in message


class InputRoutes(nn.Module):
    """Every rank calls pre, a and b; whether b's input requires grad differs between ranks (rank 0 feeds
    it a's output, the others the raw input). ``frozen``: b is frozen, so only rank 0's b has a backward."""

    def __init__(self, frozen: bool) -> None:
        super().__init__()
        self.pre, self.a, self.b, self.head = (nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4),
                                               nn.Linear(4, 1))
        self.b.requires_grad_(not frozen)

    def forward(self, x, use_a: bool):
        ha = self.a(self.pre(x))
        return self.head(self.b(ha if use_a else x))


def input_routes(rank: int, world_size: int, frozen: bool) -> dict:
    torch.manual_seed(0)
    model = InputRoutes(frozen)
    x = torch.arange(8.0).view(2, 4) * (rank + 1) / 8
    if world_size:
        for sub in (model.pre, model.a, model.b):
            perparam.fully_shard(sub)
        perparam.fully_shard(model)
    for _ in range(2):
        model.zero_grad()
        model(x, use_a=rank == 0).sum().backward()
    return {n: _full(p.grad) for n, p in model.named_parameters()}


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
def test_whether_a_groups_input_requires_grad_may_differ_between_ranks(frozen):
    want = _mean_over_ranks([input_routes(rank, 0, frozen) for rank in range(2)])
    for got in run_distributed(input_routes, 2, frozen, timeout=30):
        assert {n for n, g in got.items() if g is not None} == set(want)
        for name, grad in want.items():
            torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=0, msg=name)


class DeepBranch(nn.Module):
    """Six sharded layers, then a sharded branch every rank calls but only the last rank uses: the ranks'
    backwards reach the branch at very different times (its reduction waits for the final callback on
    the others), which must never deadlock against the layers' all-gathers."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(6))
        self.aux = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x, use_aux: bool):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        a = self.aux(x)
        if use_aux:
            x = x + a
        return self.head(x)


def deep_branch(rank: int, world_size: int, hsdp: bool) -> dict:
    torch.manual_seed(0)
    model = DeepBranch()
    x = torch.arange(8.0).view(2, 4) * (rank + 1) / 8
    if world_size:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, world_size // 2),
                                mesh_dim_names=("replicate", "shard")) if hsdp else None
        for sub in (*model.layers, model.aux):
            perparam.fully_shard(sub, mesh=mesh)
        perparam.fully_shard(model, mesh=mesh)
    for _ in range(2):
        model.zero_grad()
        model(x, use_aux=rank == max(world_size, 1) - 1).sum().backward()
    return {n: _full(p.grad) for n, p in model.named_parameters()}


@pytest.mark.parametrize(("world", "hsdp"), [(2, False), (4, True)], ids=["1d", "hsdp2x2"])
def test_a_branch_used_by_one_rank_late_in_backward_never_deadlocks(world, hsdp):
    _check_deep_branch(world, run_distributed(deep_branch, world, hsdp, timeout=60))


def _check_deep_branch(world: int, results: list[dict]) -> None:
    """Each rank's gradients equal the mean over ranks of single-process DeepBranch gradients (the last
    rank uses the branch)."""
    per_rank = []
    for rank in range(world):
        torch.manual_seed(0)
        model = DeepBranch()
        model(torch.arange(8.0).view(2, 4) * (rank + 1) / 8, use_aux=rank == world - 1).sum().backward()
        per_rank.append({n: p.grad for n, p in model.named_parameters()})
    want = _mean_over_ranks(per_rank)
    for got in results:
        for name, grad in want.items():
            torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=0, msg=name)


def deep_branch_replicated(rank: int, world_size: int, mesh_shape: tuple[int, ...]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate

    torch.manual_seed(0)
    model = DeepBranch()
    x = torch.arange(8.0).view(2, 4) * (rank + 1) / 8
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")[-len(mesh_shape):])
    for sub in model.layers:
        perparam.fully_shard(sub, mesh=mesh)
    perparam.fully_shard(model.aux, mesh=mesh,
                         param_policy={"*": perparam.ParamPolicy(placement=Replicate())})
    perparam.fully_shard(model, mesh=mesh)
    for _ in range(2):
        model.zero_grad()
        model(x, use_aux=rank == world_size - 1).sum().backward()
    return {n: _full(p.grad) for n, p in model.named_parameters()}


@pytest.mark.parametrize("mesh_shape", [(2,), (3,), (2, 2), (3, 1)], ids=["2", "3", "hsdp2x2", "hsdp3x1"])
def test_a_branch_of_replicated_parameters_used_by_one_rank_never_deadlocks(mesh_shape):
    # replicated parameters' gradients are all-reduced, not reduce-scattered: that all-reduce was
    # blocking, so the ranks that had the branch's gradient waited in it for the last rank, which waited in
    # an all-gather they had yet to issue (a hang on every mesh here); it is now queued, never waited for
    # in backward, and its all-reduce over the replicate axis is issued in queue order like the sharded
    # reductions' (on one process group the two orders once differed between ranks: gloo aborted on 3 x 1)
    world = math.prod(mesh_shape)
    _check_deep_branch(world, run_distributed(deep_branch_replicated, world, mesh_shape, timeout=60))


class SkippedBranch(nn.Module):
    """``a -> c -> [b] -> head``: only rank 0 calls ``b``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x, call_b: bool):
        h = self.c(torch.relu(self.a(x)))
        if call_b:
            h = h + self.b(h)
        return self.head(h)


def skipped_branch_in_debug_mode(rank: int, world_size: int) -> str:
    """Rank 1 skips ``b`` (its own group); the root keeps its parameters for backward, so rank 1's next
    collective is the root's gradient reduction, on the reduction group, while rank 0 checks ``b``'s
    all-gather: no check can pair up (it hung). The error, then this rank's process groups torn down
    (unusable after it)."""
    torch.manual_seed(0)
    model = SkippedBranch()
    perparam.fully_shard(model.b)
    perparam.fully_shard(model)
    perparam.set_debug(True, timeout_s=2)
    try:
        model(torch.ones(2, 4), call_b=rank == 0).sum().backward()
        message = "no error"
    except perparam.CollectiveMismatchError as e:
        message = str(e)
    finally:
        perparam.set_debug(False, timeout_s=60)
    del model
    import gc

    gc.collect()
    dist.destroy_process_group()  # its check's all-gather is left unfinished: no barrier after it
    return message


def test_debug_mode_names_the_rank_that_skipped_a_branch_instead_of_hanging():
    rank0, rank1 = run_distributed(skipped_branch_in_debug_mode, 2, timeout=60)
    assert "rank 0 waited 2 s" in rank0 and "all_gather" in rank0 and "'b'" in rank0, rank0
    assert ("ranks [1] did not reach this check" in rank0
            and "rank 1: last posted reduce_scatter" in rank0), rank0
    assert "rank 1 waited 2 s" in rank1 and "ranks [0] did not reach" in rank1, rank1
    assert "rank 0: last posted all_gather" in rank1 and "'b'" in rank1, rank1


def test_set_debug_refuses_a_value_that_is_not_a_bool():
    for bad in ("no", 0, None):  # "no" would otherwise turn the checks on
        with pytest.raises(TypeError, match="set_debug takes True or False"):
            perparam.set_debug(bad)
    assert not perparam.comm.debug.debug_enabled()
