"""Property tests of ``perparam.sharding.layout.local_shape_and_offset`` on 2D meshes (one process, no process
group): for every factorisation of world sizes 1-8 into two axes, the local shape and global offset of
every rank follow nested ``torch.chunk`` on a real tensor, agree with DTensor's own
``compute_local_shape_and_global_offset``, and the pieces reassemble the tensor exactly."""

from __future__ import annotations

import math
from functools import cache

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from perparam.sharding.layout import local_shape_and_offset

pytestmark = pytest.mark.fast

MESH_SHAPES = [(a, n // a) for n in range(1, 9) for a in range(1, n + 1) if n % a == 0]


@cache
def fake_mesh(mesh_shape: tuple[int, int], rank: int) -> DeviceMesh:
    """A ``DeviceMesh`` as seen by ``rank``, with no process group behind it (``_init_backend=False``)."""
    return DeviceMesh("cpu", torch.arange(math.prod(mesh_shape)).view(mesh_shape), _init_backend=False,
                      _rank=rank)


def placement_pairs(ndim: int) -> list[tuple]:
    choices = [Replicate()] + [Shard(d) for d in range(ndim)]
    return [(a, b) for a in choices for b in choices]


@st.composite
def cases(draw):
    mesh_shape = draw(st.sampled_from(MESH_SHAPES))
    ndim = draw(st.integers(1, 3))
    world = math.prod(mesh_shape)
    # dims from 0 to past the world size: empty tensors, dims smaller than an axis, uneven and even splits
    shape = tuple(draw(st.integers(0, 2 * world + 2)) for _ in range(ndim))
    placements = draw(st.sampled_from(placement_pairs(ndim)))
    return mesh_shape, shape, placements


def nested_chunk(full: torch.Tensor, mesh_shape, placements, coordinate) -> tuple[torch.Tensor, list[int]]:
    """The piece at ``coordinate`` by chunking a real tensor axis by axis, and its offset in ``full``
    (an empty piece sits at the end of the dim, DTensor's convention)."""
    piece, offset = full, [0] * full.dim()
    for axis_size, placement, coord in zip(mesh_shape, placements, coordinate):
        if isinstance(placement, Shard):
            d = placement.dim
            chunks = piece.chunk(axis_size, dim=d) if piece.shape[d] else ()
            offset[d] += sum(c.shape[d] for c in chunks[:coord])
            piece = chunks[coord] if coord < len(chunks) else piece.narrow(d, piece.shape[d], 0)
            if piece.shape[d] == 0:
                offset[d] = full.shape[d]
    return piece, offset


def region(shape, offset) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offset, shape))


@settings(max_examples=500, deadline=None)
@given(cases())
def test_local_shape_and_offset_is_nested_chunk_and_dtensor_and_reassembles(case):
    mesh_shape, shape, placements = case
    full = torch.arange(math.prod(shape), dtype=torch.int64).view(shape)
    rebuilt = torch.full_like(full, -1)
    copies = torch.zeros_like(full)
    for rank in range(math.prod(mesh_shape)):
        coordinate = divmod(rank, mesh_shape[1])
        local_shape, offset = local_shape_and_offset(shape, mesh_shape, placements, coordinate)
        piece, chunk_offset = nested_chunk(full, mesh_shape, placements, coordinate)
        assert local_shape == tuple(piece.shape), (rank, coordinate)
        assert list(offset) == chunk_offset, (rank, coordinate)
        assert torch.equal(full[region(local_shape, offset)], piece)
        dt_shape, dt_offset = compute_local_shape_and_global_offset(shape, fake_mesh(mesh_shape, rank),
                                                                    placements)
        assert local_shape == tuple(dt_shape), (rank, coordinate)
        if piece.numel():  # see test_empty_shard_offsets_match_dtensor for empty pieces
            assert offset == tuple(dt_offset), (rank, coordinate)
        rebuilt[region(local_shape, offset)] = piece
        copies[region(local_shape, offset)] += 1
    assert torch.equal(rebuilt, full)
    # Shard axes partition, Replicate axes copy: every element is held once per replica
    replicas = math.prod(size for size, p in zip(mesh_shape, placements) if isinstance(p, Replicate))
    assert bool((copies == replicas).all())


def test_fake_mesh_coordinates_are_row_major():
    for mesh_shape in MESH_SHAPES:
        for rank in range(math.prod(mesh_shape)):
            assert fake_mesh(mesh_shape, rank).get_coordinate() == divmod(rank, mesh_shape[1])


def test_empty_shard_offsets_match_dtensor():
    # 4 rows on a (2, 4) mesh, (Shard(0), Shard(0)): the first axis leaves 2 rows per half, the second
    # splits them in chunks of 1, so coordinates (i, 2) and (i, 3) hold no rows.
    mesh_shape, shape, placements = (2, 4), (4, 3), (Shard(0), Shard(0))
    mismatches = {}
    for rank in range(8):
        coordinate = divmod(rank, 4)
        ours = local_shape_and_offset(shape, mesh_shape, placements, coordinate)
        theirs = compute_local_shape_and_global_offset(shape, fake_mesh(mesh_shape, rank), placements)
        if ours != theirs:
            mismatches[coordinate] = (ours, theirs)
    # e.g. (0, 2): perparam ((0, 3), (2, 0)), DTensor ((0, 3), (4, 0))
    assert not mismatches, mismatches
