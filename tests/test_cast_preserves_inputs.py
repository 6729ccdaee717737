"""Mixed-precision casts of forward inputs change the dtype of floating tensors and nothing else."""

from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple

import pytest
import torch
from torch import nn

import perparam
from perparam.runtime.cast import cast_floating
from tests.distributed import run_distributed

pytestmark = pytest.mark.fast


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    scale: float = dataclasses.field(default=1.0, init=False)


@dataclasses.dataclass(frozen=True, slots=True)
class FrozenSlots:
    x: torch.Tensor
    ids: torch.Tensor
    note: str = dataclasses.field(default="default", init=False)


class Pair(NamedTuple):
    a: torch.Tensor
    b: int


def test_init_false_fields_frozen_and_slots_dataclasses_come_back_unchanged():
    b = Batch(torch.ones(2))
    b.scale = 3.0
    out = cast_floating(b, torch.bfloat16)
    assert out is not b and out.scale == 3.0 and out.x.dtype == torch.bfloat16 and b.x.dtype == torch.float32
    f = FrozenSlots(torch.ones(2), torch.arange(2))
    object.__setattr__(f, "note", "set by the caller")
    g = cast_floating(f, torch.bfloat16)
    assert g.note == "set by the caller" and g.x.dtype == torch.bfloat16 and g.ids is f.ids


def test_containers_keep_their_type_and_untouched_objects_keep_their_identity():
    ids, flag = torch.arange(3), torch.tensor([True])
    dd = collections.defaultdict(list, {"x": torch.ones(1), "ids": ids})
    nested = {"pair": Pair(torch.ones(1), 7), "dd": dd, "list": [ids, "text", None],
              "od": collections.OrderedDict(z=torch.ones(1), a=flag)}
    out = cast_floating(nested, torch.bfloat16)
    assert type(out["pair"]) is Pair and out["pair"].b == 7 and out["pair"].a.dtype == torch.bfloat16
    assert type(out["dd"]) is collections.defaultdict and out["dd"].default_factory is list
    assert out["dd"]["ids"] is ids
    assert out["list"] is nested["list"]  # nothing floating inside: the very same list
    assert list(out["od"]) == ["z", "a"] and out["od"]["a"] is flag
    same = (ids, [flag], {"k": "v"})
    assert cast_floating(same, torch.bfloat16) is same
    bf = torch.ones(2, dtype=torch.bfloat16)
    assert cast_floating(bf, torch.bfloat16) is bf
    assert cast_floating(torch.ones(2, dtype=torch.complex64), torch.bfloat16).dtype == torch.complex64


class UsesScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, batch: Batch):
        return self.lin(batch.x) * batch.scale, batch.scale


def forward_sees_the_callers_field(rank: int, world_size: int) -> float:
    model = UsesScale()
    perparam.fully_shard(model, mp_policy=perparam.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    batch = Batch(torch.ones(1, 2))
    batch.scale = 3.0
    return model(batch)[1]


def test_a_forward_input_dataclass_keeps_its_init_false_field():
    assert run_distributed(forward_sees_the_callers_field, 1) == [3.0]
