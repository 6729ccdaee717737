"""A seam for custom collectives, as FSDP2's ``set_custom_all_gather`` / ``set_custom_reduce_scatter``:
objects with FSDP2's ``AllGather`` / ``ReduceScatter`` interface replace perparam's own, with the same
results."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import perparam
from perparam import CommCounter
from tests.distributed import CountingAllGather, run_distributed
from tests.models import TinyNet, local_slice, make_batches


class CountingReduceScatter(CountingAllGather):
    """FSDP2's ``ReduceScatter`` interface over ``dist.reduce_scatter_tensor``."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def train_with(rank: int, world_size: int, custom: bool) -> dict:
    torch.manual_seed(0)
    model = TinyNet()  # Embedding(5, d), Linear(d, 2): uneven and empty shards on 3 ranks
    modules = [*model.blocks, model]
    for m in modules:
        perparam.fully_shard(m)
    gather, scatter = CountingAllGather(), CountingReduceScatter()
    if custom:
        for m in modules:
            m.set_custom_all_gather(gather)
            m.set_custom_reduce_scatter(scatter)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with CommCounter() as comm:
        for x, y in make_batches(2, 6):
            F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
            opt.step()
            opt.zero_grad()
    return {"params": {n: p.full_tensor() for n, p in model.named_parameters()},
            "calls": (gather.calls, scatter.calls),
            "counted": (comm.count("all_gather"), comm.count("reduce_scatter"))}


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.fast)])
def test_custom_all_gather_and_reduce_scatter_train_like_perparams_own(world_size):
    own = run_distributed(train_with, world_size, False)
    custom = run_distributed(train_with, world_size, True)
    for a, b in zip(own, custom):
        # every collective went there
        assert b["calls"] == b["counted"] and b["calls"][0] > 0 and b["calls"][1] > 0
        assert a["counted"] == b["counted"]
        for name, value in a["params"].items():  # SGD: a scale error would show; sum order may differ (K = 3)
            torch.testing.assert_close(b["params"][name], value, atol=1e-6, rtol=1e-5, msg=name)


def refuse_bad_comm(rank: int, world_size: int) -> str:
    model = torch.nn.Linear(4, 2)
    perparam.fully_shard(model)
    try:
        model.set_custom_all_gather(object())
    except TypeError as e:
        return str(e)
    return "no error"


def test_an_object_without_the_interface_is_refused_with_what_to_pass():
    (message,) = run_distributed(refuse_bad_comm, 1)
    assert "set_custom_all_gather" in message and "allocate(size" in message and "AllGather" in message
