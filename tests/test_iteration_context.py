"""Each root owns its iteration's state: two sharded models in one process interleave their forwards and
backwards without sharing in-flight reductions, orders or buffers; illegal state transitions raise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from perparam import StateError
from perparam.runtime.group import group_of
from perparam.runtime.state import TrainingState
from tests.distributed import one_process, run_distributed
from tests.models import TinyNet, local_slice, make_batches, shard_blocks_then_root


def two_models(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    a, b = TinyNet(), TinyNet(d=4, n_blocks=3)
    if world_size:
        shard_blocks_then_root(a)
        shard_blocks_then_root(b)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (a, b)]
    for step, (x, y) in enumerate(make_batches(3, 4)):
        if world_size:
            x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        out_a = a(x)  # a's forward, then b's whole step, then a's backward
        F.mse_loss(b(x), y).backward()
        F.mse_loss(out_a, y).backward()
        if step == 2:  # one backward through both models at once
            (F.mse_loss(a(x), y) + F.mse_loss(b(x), y)).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    full = {f"{tag}.{n}": (p.full_tensor() if isinstance(p, DTensor) else p.detach())
            for tag, m in (("a", a), ("b", b)) for n, p in m.named_parameters()}
    contexts = {id(group_of(m).ctx) for m in (a, b)} if world_size else set()
    return {"params": full, "contexts": len(contexts)}


@pytest.mark.fast
def test_two_models_in_one_process_keep_their_own_iteration_state():
    want = one_process(two_models)["params"]
    for got in run_distributed(two_models, 2):
        assert got["contexts"] == 2
        for name, value in want.items():
            torch.testing.assert_close(got["params"][name], value, atol=1e-5, rtol=0, msg=name)


def illegal_transition(rank: int, world_size: int) -> str:
    model = TinyNet()
    shard_blocks_then_root(model)
    group = group_of(model.blocks[0])
    group.transition(TrainingState.PRE_BACKWARD)
    try:
        group.transition(TrainingState.FORWARD)
    except StateError as e:
        return str(e)
    return "no error"


def test_an_illegal_state_transition_raises():
    (message,) = run_distributed(illegal_transition, 1)
    assert "pre_backward to forward" in message and "reset()" in message


@pytest.mark.parametrize("state", list(TrainingState))
def test_every_state_can_be_left(state):
    from perparam.runtime.state import ALLOWED

    assert ALLOWED[state], state
    assert TrainingState.IDLE in ALLOWED[state] or state is TrainingState.IDLE
