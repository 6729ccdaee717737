"""Property tests of the pure layout (one process, no collectives): shards reassemble exactly, local
shapes follow torch.chunk, padding is minimal, packed buffers round-trip."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard

from perparam.runtime.reduction import pack_reduce_scatter_input
from perparam.sharding.layout import (
    GroupLayout,
    ShardLayout,
    chunk_extent,
    local_shape_and_offset,
    reduce_scatter_offsets,
)

pytestmark = pytest.mark.fast

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8, torch.int8]


@st.composite
def shapes(draw, world_size: int):
    dim0 = draw(st.integers(0, 3 * world_size))
    rest = draw(st.lists(st.integers(1, 4), min_size=0, max_size=2))
    return (dim0, *rest)


@st.composite
def layouts(draw):
    k = draw(st.integers(1, 8))
    return ShardLayout(draw(shapes(k)), draw(st.sampled_from(DTYPES)), k)


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_local_shapes_follow_torch_chunk_and_reassemble_exactly(lay):
    full = torch.arange(lay.numel, dtype=torch.float64).reshape(lay.global_shape)
    chunks = full.chunk(lay.num_shards, dim=0) if lay.global_shape[0] else ()
    pieces = []
    for rank in range(lay.num_shards):
        start, length = lay.extent(rank)
        piece = full.narrow(0, start, length)
        want = chunks[rank].shape if rank < len(chunks) else (0, *lay.global_shape[1:])
        assert tuple(piece.shape) == tuple(want) == lay.local_shape(rank)
        assert lay.local_bytes(rank) == piece.numel() * lay.itemsize
        pieces.append(piece)
    assert torch.equal(torch.cat(pieces), full)


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_padding_is_minimal(lay):
    n, k = lay.global_shape[0], lay.num_shards
    row = math.prod(lay.global_shape[1:])
    assert lay.chunk * k >= n and (lay.chunk - 1) * k < n or n == 0
    assert lay.padded_local_numel == lay.chunk * row
    assert sum(lay.padding_numel(r) for r in range(k)) == (lay.chunk * k - n) * row
    assert all(lay.padding_numel(r) >= 0 for r in range(k))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8).flatmap(lambda k: st.lists(
    st.tuples(shapes(k), st.sampled_from(DTYPES)), min_size=1, max_size=6).map(lambda ps: (k, ps))))
def test_packed_all_gather_buffer_round_trips_any_mix_of_dtypes(case):
    k, params = case
    lays = tuple(ShardLayout(s, d, k) for s, d in params)
    group = GroupLayout.plain(lays, tuple(d for _, d in params))
    offsets = [o[0] for o in group.offsets]
    sizes = [ps[0].nbytes for ps in group.pieces]
    fulls = [(torch.randint(0, 100, s) if not d.is_floating_point else torch.randn(s)).to(d)
             for s, d in params]
    # every rank packs its padded local shards into its slot
    gathered = torch.zeros(k, group.slot_bytes, dtype=torch.uint8)
    for rank in range(k):
        for lay, full, off, nbytes in zip(lays, fulls, offsets, sizes):
            assert off % lay.itemsize == 0  # aligned for .view(dtype)
            start, length = lay.extent(rank)
            padded = torch.zeros(lay.padded_local_shape, dtype=lay.dtype)
            padded.narrow(0, 0, length).copy_(full.narrow(0, start, length))
            gathered[rank, off:off + nbytes] = padded.reshape(-1).view(torch.uint8)
    # and every parameter unpacks exactly
    for lay, full, off, nbytes in zip(lays, fulls, offsets, sizes):
        mine = gathered[:, off:off + nbytes].reshape(-1).view(lay.dtype).view(lay.padded_global_shape)
        assert torch.equal(mine.narrow(0, 0, lay.global_shape[0]), full)
    # no gaps: the slot is exactly the sum of the pieces
    assert group.slot_bytes == sum(sizes)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8).flatmap(lambda k: st.lists(shapes(k), min_size=1, max_size=5).map(lambda s: (k, s))))
def test_reduce_scatter_offsets_match_the_packed_gradients(case):
    k, shape_list = case
    lays = [ShardLayout(s, torch.float32, k) for s in shape_list]
    offsets, total = reduce_scatter_offsets(lays)
    grads = [torch.randn(s) for s in shape_list]
    flags = torch.arange(len(grads), dtype=torch.float32)
    packed = pack_reduce_scatter_input(grads, k, flags=flags)
    assert packed.shape == (k, total)
    # every rank's piece ends with the same used flags, one per parameter
    assert torch.equal(packed[:, total - len(grads):], flags.expand(k, -1))
    for rank in range(k):
        for lay, grad, off in zip(lays, grads, offsets):
            start, length = lay.extent(rank)
            mine = packed[rank, off:off + lay.padded_local_numel].view(lay.padded_local_shape)
            assert torch.equal(mine.narrow(0, 0, length), grad.narrow(0, start, length))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 40), st.integers(1, 8), st.data())
def test_chunk_extent_is_torch_chunk(size, k, data):
    rank = data.draw(st.integers(0, k - 1))
    chunks = torch.arange(size).chunk(k) if size else ()
    start, length = chunk_extent(size, k, rank)
    if rank < len(chunks):
        assert torch.equal(torch.arange(size)[start:start + length], chunks[rank])
    else:
        assert length == 0


def test_local_shape_and_offset_nests_chunks_left_to_right():
    # (Replicate, Shard(0)) on a 2x3 mesh: the replicate axis does not split
    shape, offset = local_shape_and_offset((7, 2), (2, 3), (Replicate(), Shard(0)), (1, 2))
    assert shape == (1, 2) and offset == (6, 0)
    # Shard(0) on both axes: chunk 7 rows in 2 (4, 3), then the second piece in 3 (1, 1, 1)
    shape, offset = local_shape_and_offset((7,), (2, 3), (Shard(0), Shard(0)), (1, 1))
    assert shape == (1,) and offset == (5,)
