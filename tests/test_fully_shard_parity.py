"""Parity: a sharded run equals a single-process run on the same global batch (fp32, 1e-5)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from tests.distributed import one_process, run_distributed
from tests.models import TinyNet, local_slice, make_batches, mean_over_ranks, sharded_tiny

STEPS, GLOBAL_BATCH, TOL = 10, 12, 1e-5


def _all_sharded(model: torch.nn.Module) -> bool:
    return all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in model.parameters())


def _full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def reference(call_twice: bool = False, micro_batches: int = 1, eval_every: int = 0) -> tuple[list, dict]:
    """Single process, whole global batch (split into micro-batches the same way when accumulating)."""
    torch.manual_seed(0)
    model = TinyNet(call_twice=call_twice)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step, (x, y) in enumerate(make_batches(STEPS, GLOBAL_BATCH)):
        total = 0.0
        for mx, my in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            loss = F.mse_loss(model(mx), my) / micro_batches
            loss.backward()
            total += loss.item()
        if eval_every and step % eval_every == 0:
            with torch.no_grad():
                model(x)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, _full_params(model)


def sharded_run(rank: int, world_size: int, call_twice: bool = False, micro_batches: int = 1,
                eval_every: int = 0, reshard_after_forward: bool | None = None) -> tuple[list, dict]:
    model = sharded_tiny(call_twice=call_twice, reshard_after_forward=reshard_after_forward)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step, (x, y) in enumerate(make_batches(STEPS, GLOBAL_BATCH)):
        x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        total = 0.0
        for i, (mx, my) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
            model.set_requires_gradient_sync(i == micro_batches - 1)
            loss = F.mse_loss(model(mx), my) / micro_batches
            assert _all_sharded(model), "parameters must be sharded DTensors after forward"
            loss.backward()
            assert _all_sharded(model), "parameters must be sharded DTensors after backward"
            total += mean_over_ranks(loss)
        if eval_every and step % eval_every == 0:
            with torch.no_grad():
                model(x)
            with torch.inference_mode():
                model(x)
            assert _all_sharded(model)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, _full_params(model)


def _assert_close(got: tuple[list, dict], want: tuple[list, dict]) -> None:
    losses, params = got
    ref_losses, ref_params = want
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL, (losses, ref_losses)
    assert params.keys() == ref_params.keys()
    for name, value in params.items():
        torch.testing.assert_close(value, ref_params[name], atol=TOL, rtol=0, msg=name)


@pytest.mark.parametrize("world_size", [1, 2, pytest.param(3, marks=pytest.mark.fast), 4])
def test_nested_uneven_and_empty_shards_match_single_process(world_size):
    want = reference()
    for got in run_distributed(sharded_run, world_size):
        _assert_close(got, want)


def test_world_size_one_is_bitwise_equal():
    want = reference()
    losses, params = run_distributed(sharded_run, 1)[0]
    assert losses == want[0]
    assert all(torch.equal(params[n], want[1][n]) for n in params)


@pytest.mark.parametrize("world_size", [2, 3])
def test_gradient_accumulation_without_sync_matches(world_size):
    want = reference(micro_batches=2)
    for got in run_distributed(sharded_run, world_size, False, 2):
        _assert_close(got, want)


def test_module_called_twice_matches():
    want = reference(call_twice=True)
    for got in run_distributed(sharded_run, 3, True):
        _assert_close(got, want)


def test_eval_forwards_in_between_match():
    want = reference(eval_every=3)
    for got in run_distributed(sharded_run, 2, False, 1, 3):
        _assert_close(got, want)


def test_no_reshard_after_forward_matches():
    want = reference()
    for got in run_distributed(sharded_run, 3, False, 1, 0, False):
        _assert_close(got, want)


def several_forwards_then_one_backward(rank: int, world_size: int) -> dict:
    model = sharded_tiny(shard=bool(world_size))
    (x1, y1), (x2, y2) = make_batches(2, GLOBAL_BATCH)
    if world_size > 1:
        x1, y1, x2, y2 = (local_slice(t, rank, world_size) for t in (x1, y1, x2, y2))
    loss = F.mse_loss(model(x1), y1) + F.mse_loss(model(x2), y2)
    with torch.no_grad():
        model(x1)
    loss.backward()
    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
            for n, p in model.named_parameters()}


def test_several_forwards_before_one_backward():
    want = one_process(several_forwards_then_one_backward)
    for got in run_distributed(several_forwards_then_one_backward, 2):
        for name, grad in got.items():
            torch.testing.assert_close(grad, want[name], atol=TOL, rtol=0, msg=name)
