"""Property tests of the placement rules (``perparam.sharding.placement.rule``) through ``ShardLayout``, in
one process: random shapes (0-dim and empty dims included), shard axes of 1-8 ranks, HSDP meshes, and
``Shard(0)``, ``Shard(d > 0)`` and ``Replicate()``. Every rank's piece is what ``torch.chunk`` (or DTensor)
gives, the all-gather buffer reassembles the tensor, and the reduce-scatter packing hands each rank its own
piece. ``Shard(0)`` and ``Replicate()`` are never confused (the old ``shard_dim`` convention's risk)."""

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

from perparam.runtime.reduction import pack_reduce_scatter_input
from perparam.sharding.layout import GroupLayout, ShardLayout, local_shape_and_offset, wire_pieces
from perparam.sharding.placement import normalize, rule

pytestmark = pytest.mark.fast


@cache
def fake_mesh(mesh_shape: tuple[int, ...], rank: int) -> DeviceMesh:
    return DeviceMesh("cpu", torch.arange(math.prod(mesh_shape)).view(mesh_shape), _init_backend=False,
                      _rank=rank)


@st.composite
def cases(draw):
    k = draw(st.integers(1, 8))
    ndim = draw(st.integers(0, 3))
    # sizes from 0 to past K: empty tensors, dims smaller than K (empty local shards), uneven and even splits
    shape = tuple(draw(st.integers(0, 2 * k + 2)) for _ in range(ndim))
    choices = [Replicate()] + [Shard(d) for d in range(ndim)]
    placement = draw(st.sampled_from(choices))
    replicas = draw(st.sampled_from([1, 2]))
    return ShardLayout(shape, torch.float32, k, placement), replicas


@settings(max_examples=150, deadline=None)
@given(cases())
def test_every_rank_holds_its_torch_chunk_and_the_gathered_buffer_reassembles(case):
    lay, replicas = case
    shape, k = lay.global_shape, lay.num_shards
    full = torch.arange(lay.numel, dtype=torch.float32).reshape(shape)
    gathered = isinstance(lay.placement, Shard)
    assert lay.gathered is gathered
    assert (wire_pieces(lay, torch.float32) == ()) is not gathered  # replicated: not all-gathered
    if gathered:
        d = lay.placement.dim
        chunks = full.chunk(k, dim=d) if shape[d] else ()
    buffer = torch.full(lay.buffer_shape, float("nan"))
    for rank in range(k):
        piece = lay.local_piece(full, rank)
        if gathered:
            want = chunks[rank] if rank < len(chunks) else full.narrow(d, shape[d], 0)
            assert torch.equal(piece, want)
        else:
            assert piece is full and lay.extent(rank) == (0, shape[0] if shape else 1)
        assert tuple(piece.shape) == lay.local_shape(rank)
        assert lay.local_bytes(rank) == piece.numel() * 4
        assert lay.padding_numel(rank) >= 0
        # DTensor agrees, on 1D and HSDP meshes (the replicate axis changes nothing a rank holds)
        mesh_shape, placements = ((k,), (lay.placement,)) if replicas == 1 else (
            (replicas, k), (Replicate(), lay.placement))
        coord = (rank,) if replicas == 1 else (replicas - 1, rank)
        ours = local_shape_and_offset(shape, mesh_shape, placements, coord)
        mesh = fake_mesh(mesh_shape, rank if replicas == 1 else (replicas - 1) * k + rank)
        theirs = compute_local_shape_and_global_offset(shape, mesh, placements)
        assert ours[0] == tuple(theirs[0]) == lay.local_shape(rank)
        if piece.numel():
            assert ours[1] == tuple(theirs[1])
        # the all-gather: each rank sends its padded piece in the parameter's dim order
        if gathered:
            wire = torch.zeros(lay.padded_local_numel)
            lay.send_view(wire, rank).copy_(piece)
        else:  # a replicated parameter fills the buffer from the local tensor
            wire = piece.reshape(-1)
        if gathered or rank == 0:
            for dst, src in lay.copy_out_pairs(buffer, wire.reshape(1, -1), rank if gathered else 0):
                dst.copy_(src)
    assert torch.equal(lay.unpad(buffer), full)
    assert lay.unpad(buffer).is_contiguous()  # what the module computes with, whatever the placement
    assert math.prod(lay.padded_global_shape) == lay.padded_local_numel * (k if gathered else 1)


@settings(max_examples=100, deadline=None)
@given(cases())
def test_reduce_scatter_packing_gives_each_rank_its_own_piece(case):
    lay, _ = case
    if not lay.gathered:
        return  # replicated gradients are all-reduced whole
    grad = torch.randn(lay.global_shape)
    k = lay.num_shards
    send = pack_reduce_scatter_input([lay.to_wire(grad)], k)  # what take_unsharded_grad hands the group
    for rank in range(k):
        start, length = lay.extent(rank)
        local = send[rank].narrow(0, 0, lay.padded_local_numel).view(lay.wire_shape).narrow(0, 0, length)
        assert torch.equal(lay.from_wire(local, contiguous=True), lay.local_piece(grad, rank))
    group = GroupLayout.plain((lay,), (torch.float32,))
    assert group.slot_bytes == lay.padded_local_numel * 4


def test_shard0_and_replicate_are_told_apart():
    """The old convention carried ``shard_dim: int | None`` and branched with ``if dim:``, which reads
    ``Shard(0)`` (0) and ``Replicate()`` (None) alike; a placement object cannot be confused."""
    shard0, rep = (ShardLayout((5, 3), torch.float32, 2, Shard(0)),
                   ShardLayout((5, 3), torch.float32, 2, Replicate()))
    assert shard0.gathered and not rep.gathered
    assert shard0.local_shape(1) == (2, 3) and rep.local_shape(1) == (5, 3)
    # a 0-dim replicated parameter: its wire shape used to be indexed at dim 0 (IndexError)
    scalar = ShardLayout((), torch.float32, 3, Replicate())
    assert scalar.wire_shape == scalar.buffer_shape == () and scalar.local_shape(2) == ()
    with pytest.raises(TypeError, match="Placement"):
        ShardLayout((5, 3), torch.float32, 2, 0)
    with pytest.raises(ValueError, match="out of range"):
        ShardLayout((5, 3), torch.float32, 2, Shard(2))
    with pytest.raises(ValueError, match="out of range"):
        ShardLayout((), torch.float32, 2, Shard(0))


def test_normalize_makes_placements_concrete_and_says_what_a_0_dim_parameter_needs():
    assert normalize(None, 2) == Shard(0) and normalize(Shard(-1), 3) == Shard(2)
    assert normalize(Replicate(), 0) == Replicate()
    with pytest.raises(ValueError, match=r"0-dim.*ParamPolicy\(placement=Replicate\(\)\)"):
        normalize(None, 0)
    with pytest.raises(ValueError, match="Shard"):
        rule(Shard(-1))
