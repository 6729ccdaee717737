"""FSDP2 ``FSDPModule`` methods on ``ShardedModule``: ``set_all_reduce_hook`` (a user all-reduce over the
replicate ranks makes HSDP by hand), ``set_is_last_backward`` (changes nothing: perparam finishes every
reduction in backward), ``set_reduce_scatter_max_input_buffers`` (accepted without effect, with FSDP2's
checks). ``reset_iter_state`` is tested with ``reset()`` in ``test_runtime_routes.py``."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate

import perparam
from perparam import CommCounter, ParamPolicy
from tests.distributed import run_distributed
from tests.models import local_slice, make_batches, sharded_tiny


def _small() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


def hsdp_by_hand(rank: int, world_size: int) -> dict:
    """Sharded over the 2 ranks of the shard axis of a 2 x 2 mesh; the hook all-reduces each reduction over
    the 2 replicas, and the factor divides by all 4 ranks. Biases ``Replicate()`` (a reduction of their
    own)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    model = _small()
    perparam.fully_shard(model, mesh=mesh["shard"],
                         param_policy={"*.bias": ParamPolicy(placement=Replicate())},
                         gradient_divide_factor=4)
    calls = []

    def all_reduce_over_replicas(reduced: torch.Tensor) -> None:
        calls.append((reduced.dim(), reduced.dtype))
        dist.all_reduce(reduced, group=mesh.get_group("rep"))

    model.set_all_reduce_hook(all_reduce_over_replicas)
    x, y = (t[2 * rank:2 * rank + 2] for t in _batch())
    per_backward = []
    for sync in (False, True):
        model.set_requires_gradient_sync(sync)
        F.mse_loss(model(x), y).backward()
        per_backward.append(len(calls))
    return {"grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()}, "calls": calls,
            "per_backward": per_backward}


def test_an_all_reduce_hook_over_the_replicas_matches_one_process():
    model = _small()
    x, y = _batch()
    # two backwards of the same batch (the first without sync): twice the mean over 4 ranks' equal batches
    (2 * F.mse_loss(model(x), y)).backward()
    for got in run_distributed(hsdp_by_hand, 4):
        # no call without sync; then one per reduction (the sharded weights, the replicated biases)
        assert got["per_backward"] == [0, 2] and got["calls"] == [(1, torch.float32)] * 2
        for name, p in model.named_parameters():
            torch.testing.assert_close(got["grads"][name], p.grad, atol=1e-5, rtol=0, msg=name)


def refusals(rank: int, world_size: int) -> dict:
    model = nn.Linear(4, 2)
    perparam.fully_shard(model)
    out = {}
    for name, call in {"stream": lambda: model.set_all_reduce_hook(lambda t: None, stream=object()),
                       "not_callable": lambda: model.set_all_reduce_hook(3),
                       "last_backward": lambda: model.set_is_last_backward(1),
                       "max_buffers": lambda: model.set_reduce_scatter_max_input_buffers(2),
                       "max_buffers_bool": lambda: model.set_reduce_scatter_max_input_buffers(True),
                       "max_buffers_zero": lambda: model.set_reduce_scatter_max_input_buffers(0)}.items():
        try:
            call()
            out[name] = "no error"
        except (NotImplementedError, TypeError, ValueError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def test_what_perparam_cannot_honour_is_refused_with_the_reason():
    (got,) = run_distributed(refusals, 1)
    assert got["stream"].startswith("NotImplementedError") and "stream=None" in got["stream"]
    assert got["not_callable"].startswith("TypeError") and "callable" in got["not_callable"]
    assert got["last_backward"].startswith("TypeError") and "bool" in got["last_backward"]
    # FSDP2's tuning knob: accepted without effect (perparam never waits for a reduction in backward),
    # with FSDP2's checks
    assert got["max_buffers"] == "no error"
    assert got["max_buffers_bool"].startswith("TypeError") and "int" in got["max_buffers_bool"]
    assert got["max_buffers_zero"].startswith("ValueError") and "positive" in got["max_buffers_zero"]


def accumulate(rank: int, world_size: int, mark_last: bool) -> dict:
    model = sharded_tiny()
    counts = []
    for i, (x, y) in enumerate(make_batches(3, 4)):
        model.set_requires_gradient_sync(i == 2)
        if mark_last:  # FSDP2's micro-batching habit: only the last backward is the last one
            model.set_is_last_backward(i == 2)
        with CommCounter() as comm:
            F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
        counts.append(comm.by_kind())
    return {"counts": counts, "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()}}


def test_set_is_last_backward_changes_neither_gradients_nor_collectives():
    plain, marked = (run_distributed(accumulate, 2, mark) for mark in (False, True))
    for a, b in zip(plain, marked):
        assert a["counts"] == b["counts"]
        for name, value in a["grads"].items():
            assert torch.equal(b["grads"][name], value), name
