"""``placement="auto"``: never more bytes on the largest rank than ``Shard(0)``; the layout partitions the
tensor."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from perparam import ParamPolicy
from perparam.sharding.layout import ShardLayout
from perparam.sharding.placement import AUTO_REPLICATE_BYTES, auto_placement
from perparam.sharding.resolution import resolve_params

pytestmark = pytest.mark.fast

shapes = st.lists(st.integers(0, 70), min_size=1, max_size=3).map(tuple)


def _max_rank_bytes(layout: ShardLayout) -> int:
    return max(layout.local_bytes(r) for r in range(layout.num_shards))


@settings(max_examples=200, deadline=None)
@given(shape=shapes, k=st.integers(1, 80), itemsize=st.sampled_from([1, 2, 4]))
def test_auto_max_rank_bytes_at_most_shard0(shape, k, itemsize):
    dtype = {1: torch.int8, 2: torch.float16, 4: torch.float32}[itemsize]
    chosen = auto_placement(shape, itemsize, k, allow_replicate=False)
    assert isinstance(chosen, Shard)
    auto = ShardLayout(shape, dtype, k, chosen)
    shard0 = ShardLayout(shape, dtype, k, Shard(0))
    assert _max_rank_bytes(auto) <= _max_rank_bytes(shard0)
    assert auto.padded_local_numel <= shard0.padded_local_numel  # all-gather padding too
    assert sum(auto.local_bytes(r) for r in range(k)) == auto.numel * itemsize


def test_auto_picks_shard1_and_replicate_through_the_resolution_path():
    model = nn.Module()
    model.register_parameter("w", nn.Parameter(torch.empty(5, 80, device="meta")))  # 5 rows: Shard(1) at K=4
    model.register_parameter("norm", nn.Parameter(torch.empty(8, device="meta")))  # 32 bytes: replicated
    model.register_parameter("big", nn.Parameter(torch.empty(8, 400, device="meta")))  # divides: Shard(0)
    resolved = resolve_params(list(model.named_parameters()), None, ParamPolicy(placement="auto"), 4)
    assert [r.placement for r in resolved] == [Shard(1), Replicate(), Shard(0)]
    assert 8 * 4 <= AUTO_REPLICATE_BYTES < 8 * 400 * 4
