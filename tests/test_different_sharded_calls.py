"""Ranks that make different numbers of sharded calls: outside debug mode, a collective sequence a rank has
not issued before is agreed on through the store first, so gloo never pairs collectives of different sizes
(it aborted the process: SIGABRT); a collective that times out in a sharded forward names the cause, debug
mode and docs/evaluation.md. A loop that repeats its steps makes no check after its second step."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import perparam
from perparam.comm import sequence
from tests.distributed import run_distributed


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # c: empty shards on 3 ranks
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 6), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, extra: int = 0) -> torch.Tensor:  # [batch, 4] -> [batch, 2]
        x = self.a(x)
        for _ in range(extra):  # a rank-dependent number of calls
            x = self.a(x)
        return self.c(self.b(x))


def _checks() -> int:
    return sum(seen.checks for _, seen in sequence._state.values())


def different_calls(rank: int, world: int, mode: str):
    torch.manual_seed(0)
    # the mesh's process group times out after 2 s (the check waits as long as the collective would)
    mesh = DeviceMesh.from_group(dist.new_group(timeout=timedelta(seconds=2)), "cpu")
    model = Chain()
    for m in (model.a, model.b, model.c, model):
        perparam.fully_shard(m, mesh=mesh)
    checks = []
    for _ in range(4):  # the same steps on every rank: checks in the first two only
        model(torch.randn(2, 4)).sum().backward()
        checks.append(_checks())
    try:
        if mode == "train":
            model(torch.randn(2, 4), extra=rank).sum().backward()
        else:  # rank 0 evaluates 2 batches, the others 4
            with torch.no_grad():
                for _ in range(2 if rank == 0 else 4):
                    model(torch.randn(2, 4))
            if rank == 0:
                time.sleep(3.5)  # stays alive past its peers' timeout: they time out rather than lose it
    except RuntimeError as e:
        return checks, type(e).__name__, str(e)
    return checks, "no error", ""


def test_ranks_making_different_numbers_of_sharded_calls_raise_naming_the_collective_instead_of_aborting():
    for world in (2, 3):  # rank r calls 'a' r extra times
        results = run_distributed(different_calls, world, "train")
        for rank, (checks, kind, message) in enumerate(results):
            assert checks[1] == checks[2] == checks[3] > 0, checks  # nothing checked once the steps repeat
            if rank == 0:  # its collectives are the ones it issued before: it waits in one (no partner); its
                # peers may have raised and exited before its timeout: then it lost them (PeerLostError)
                assert kind in ("CollectiveMismatchError", "CollectiveTimeoutError", "PeerLostError"), message
                continue
            assert kind == "CollectiveMismatchError", message
            assert "group #0 'a'" in message and "different numbers of sharded calls" in message, message
            if world == 3:
                assert "ranks [0] did not reach the same point within 2 s" in message, message
                assert "perparam.set_debug(True)" in message and "docs/evaluation.md" in message, message


def test_a_sharded_forward_that_a_peer_never_issues_times_out_naming_debug_mode_and_the_evaluation_doc():
    results = run_distributed(different_calls, 2, "eval")
    assert results[0][1] == "no error"
    checks, kind, message = results[1]
    assert kind == "CollectiveTimeoutError", message
    assert "different numbers of sharded calls" in message and "perparam.set_debug(True)" in message, message
    assert "docs/evaluation.md" in message and "the forward of Linear 'a'" in message, message
