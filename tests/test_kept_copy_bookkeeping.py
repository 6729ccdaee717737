"""The per-parameter bookkeeping of ``state_dict()`` values (``perparam.runtime.zero.lent``) is O(1) in the
number of calls: one entry per value still alive, whatever the number of calls (it used to append one
``(id, version)`` pair per call, dropped only at the next all-gather: 90 calls, +180 kB), and a write into a
value that died since is still refused at the next forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import perparam
from perparam import ParamPolicy
from perparam.runtime.group import group_of

pytestmark = pytest.mark.fast


def _model(mesh) -> nn.Module:
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    perparam.fully_shard(model, mesh=mesh, param_policy=ParamPolicy(zero_stage=2))
    with torch.no_grad():
        model(torch.ones(2, 3))  # fills the kept copies
    return model


def _entries(model) -> list[int]:
    return [len(sp.aliases) + len(sp.write_sig or ()) for sp in group_of(model).params]


def test_state_dict_calls_keep_the_bookkeeping_per_parameter_constant(fake_mesh):
    model = _model(fake_mesh)
    model.state_dict()
    after_one = _entries(model)
    for _ in range(90):
        model.state_dict()
    assert _entries(model) == after_one  # one live value at most (the last one is dropped too)
    held = [model.state_dict() for _ in range(5)]
    # stage 2 in fp32: each shard is a view of its kept copy, and every value handed out a view of one alias
    # of it (runtime/shard_view.py): one entry, however many values are alive
    assert [len(sp.aliases) for sp in group_of(model).params] == [1] * 4
    del held
    with torch.no_grad():
        model(torch.ones(2, 3))


def test_state_dict_values_of_shards_with_storage_of_their_own_are_tracked_while_alive(fake_mesh):
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    perparam.fully_shard(model, mesh=fake_mesh,
                         param_policy=ParamPolicy(zero_stage=2, param_dtype=torch.bfloat16))
    with torch.no_grad():
        model(torch.ones(2, 3, dtype=torch.bfloat16))
    held = [model.state_dict() for _ in range(5)]
    assert [len(sp.aliases) for sp in group_of(model).params] == [5] * 4  # the live ones, no more
    del held
    with torch.no_grad():
        model(torch.ones(2, 3, dtype=torch.bfloat16))


def test_a_write_into_a_state_dict_value_that_died_is_still_refused(fake_mesh):
    model = _model(fake_mesh)
    sd = model.state_dict()
    with torch.no_grad():
        sd["0.weight"]._local_tensor.mul_(2)  # what dcp.load(model.state_dict()) does in place
    del sd
    for _ in range(10):
        model.state_dict()
    with pytest.raises(perparam.UnseenShardWriteError, match="'0.weight'.*mark_shards_written"):
        with torch.no_grad():
            model(torch.ones(2, 3))
