"""The sharding layout as pure functions: which rows each rank holds, padding, local shapes, bytes.

Nothing here touches a process group or allocates a tensor, so the runtime (``group.py``), the memory
tools (``perparam.memory``) and the property tests all compute the same figures from the same code.

Terms: an *axis* is a mesh axis, a *dim* is a tensor dimension. A parameter of global shape ``S`` sharded
with ``Shard(d)`` over a mesh axis of size ``K`` is split like ``torch.chunk(t, K, dim=d)``: every rank but
the last few holds ``ceil(S[d] / K)`` slices, the last ranks may hold fewer or none. For the collectives
each rank's piece is padded to that chunk size, so all ranks send equal byte counts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch.distributed.tensor import Placement, Shard

from .placement import PlacementRule, ceil_div, chunk_extent, rule

__all__ = ["ceil_div", "chunk_extent", "ShardLayout", "WirePiece", "GroupLayout", "wire_pieces",
           "reduce_scatter_offsets", "local_shape_and_offset"]


def local_shape_and_offset(
    global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement],
    coordinate: Sequence[int],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Local shape and global offset of the piece held at mesh ``coordinate``.

    Placements are applied axis by axis, left to right: ``Shard(d)`` on an axis chunks what the earlier
    axes left of dim ``d`` (nested ``torch.chunk``), ``Replicate()`` keeps it. This is DTensor's rule for
    plain ``Shard`` placements.
    """
    if not (len(mesh_shape) == len(placements) == len(coordinate)):
        raise ValueError("mesh_shape, placements and coordinate need one entry per mesh axis")
    shape, offset = tuple(global_shape), tuple([0] * len(global_shape))
    for axis_size, placement, coord in zip(mesh_shape, placements, coordinate):
        shape, offset = rule(placement).nest(shape, offset, global_shape, axis_size, coord)
    return tuple(shape), tuple(offset)


@dataclass(frozen=True)
class ShardLayout:
    """How one parameter is split over the shard axis of a data-parallel mesh.

    ``global_shape``: the shape the shard axis splits (the parameter's, or under TP its tp-local one).
    ``dtype``: the stored dtype. ``num_shards``: K, the size of the shard axis. ``placement``: its dp
    placement, ``Shard(d)`` with ``0 <= d < ndim`` or ``Replicate()`` (a 0-dim shape needs
    ``Replicate()``). What a placement means comes from ``perparam.sharding.placement.rule``; nothing here
    branches on it. Raises ``ValueError`` for K < 1 or a placement the shape cannot take, ``TypeError`` for
    a placement that is not a ``Placement``.
    """

    global_shape: tuple[int, ...]
    dtype: torch.dtype
    num_shards: int
    placement: Placement = Shard(0)

    def __post_init__(self) -> None:
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")
        if not isinstance(self.placement, Placement):
            raise TypeError(f"ShardLayout.placement must be a Placement (Shard(d) or Replicate()), got "
                            f"{self.placement!r}")
        # made once: every figure below asks it, at each all-gather and reduction (not a field: not compared)
        object.__setattr__(self, "_rule", rule(self.placement))
        self.rule.check(self.global_shape)
        # the per-rank figures, computed at their first read (``extent``, ``local_shape``): pure functions of
        # the fields, asked for every parameter at every all-gather and reduction
        object.__setattr__(self, "_per_rank", {})

    @property
    def rule(self) -> PlacementRule:
        """The rule of ``placement`` (``perparam.sharding.placement.rule``), made once per layout."""
        return self._rule

    @cached_property
    def gathered(self) -> bool:
        """All-gathered in the group's collective (sharded); ``False``: replicated, never gathered."""
        return self.rule.gathered

    # -- sizes -----------------------------------------------------------------------------------------
    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @cached_property
    def numel(self) -> int:
        return math.prod(self.global_shape)

    @cached_property
    def chunk(self) -> int:
        """Padded extent of every rank's piece along the split dim (``ceil(S[d] / K)``; replicated: the
        whole dim 0, 1 for a 0-dim shape)."""
        return self.rule.chunk(self.global_shape, self.num_shards)

    @cached_property
    def padded_local_shape(self) -> tuple[int, ...]:
        return self.rule.padded_local_shape(self.global_shape, self.num_shards)

    @cached_property
    def padded_local_numel(self) -> int:
        return math.prod(self.padded_local_shape)

    @cached_property
    def wire_shape(self) -> tuple[int, ...]:
        """The padded local shard with the split dim moved to the front: a rank's piece of a reduce-scatter
        (``to_wire`` of the gradient), so that the K pieces stack along dim 0. An all-gather piece keeps the
        parameter's own dim order instead (``send_view``, ``copy_out_pairs``)."""
        return self.rule.wire_shape(self.padded_local_shape)

    @cached_property
    def padded_global_shape(self) -> tuple[int, ...]:
        """Shape of the all-gathered tensor before the padding is cut off (K chunks of ``chunk``)."""
        return self.rule.padded_global_shape(self.global_shape, self.num_shards)

    @cached_property
    def wire_is_layout(self) -> bool:
        """The gathered pieces, stacked in rank order, are the unsharded buffer's memory (``Shard(0)``,
        ``Replicate()``): they are copied in as bytes, and ``to_wire``/``from_wire`` return the tensor
        itself (the runtime skips them then). Otherwise (``Shard(d > 0)``) each piece is copied
        into its slices of the contiguous unsharded tensor (``copy_out_pairs``): the same bytes, in
        contiguous blocks of ``chunk * prod(shape[d + 1:])`` elements, and the tensor stays contiguous."""
        return self.rule.wire_is_layout

    @cached_property
    def buffer_shape(self) -> tuple[int, ...]:
        """The unsharded buffer: ``padded_global_shape`` (dim 0 padded to K chunks) for ``Shard(0)``, the
        gathered pieces as they arrive; ``global_shape`` (no padding) for ``Shard(d > 0)`` and
        ``Replicate()``. ``unpad`` of it is the contiguous unsharded tensor."""
        if self.gathered and self.wire_is_layout:
            return self.rule.wire_shape(self.padded_global_shape)
        return self.global_shape

    @cached_property
    def buffer_rows(self) -> int:
        """Ranks whose pieces fill the buffer as rows of bytes: K for ``Shard(0)``, 1 otherwise."""
        return self.num_shards if self.gathered and self.wire_is_layout else 1

    def send_view(self, piece: torch.Tensor, rank: int) -> torch.Tensor:
        """Where shard ``rank``'s local tensor goes in its all-gather piece ``piece`` (``padded_local_numel``
        elements): the padded local shard in the parameter's own dim order (``padded_local_shape``,
        padding at the end of the split dim), narrowed to ``local_shape(rank)``. A view."""
        view = piece.view(self.padded_local_shape)
        for i, (n, padded) in enumerate(zip(self.local_shape(rank), self.padded_local_shape)):
            if n != padded:
                view = view.narrow(i, 0, n)
        return view

    def copy_out_pairs(self, buffer: torch.Tensor, rows: torch.Tensor, first: int) -> list:
        """``(destination, source)`` views that put gathered pieces into ``buffer`` (``buffer_shape``):
        ``rows`` ``[m, padded_local_numel]`` holds the pieces (``send_view``) of ranks ``first .. first + m -
        1`` (replicated: ``[1, numel]``, the local tensor). Padding and empty ranks' pieces are skipped. Views
        only."""
        if self.gathered and self.wire_is_layout:
            rows_view = buffer.reshape(-1).view(self.buffer_rows, buffer.numel() // self.buffer_rows)
            return [(rows_view.narrow(0, first, rows.shape[0]), rows)]
        return self.rule.copy_out_pairs(buffer, rows, first, self.num_shards)

    # -- per rank --------------------------------------------------------------------------------------
    def _rank(self, rank: int) -> tuple[tuple[int, int], tuple[int, ...], int]:
        """``(extent, local_shape, local_numel)`` of shard ``rank``, computed once per rank (``ValueError``
        from ``chunk_extent`` for a rank out of range, never cached)."""
        figures = self._per_rank.get(rank)
        if figures is None:
            extent = self.rule.extent(self.global_shape, self.num_shards, rank)
            shape = self.rule.local_shape(self.global_shape, self.num_shards, rank)
            figures = self._per_rank[rank] = (extent, shape, math.prod(shape))
        return figures

    def extent(self, rank: int) -> tuple[int, int]:
        """``(start, length)`` along the split dim of the slices held by shard ``rank``."""
        return self._rank(rank)[0]

    def local_shape(self, rank: int) -> tuple[int, ...]:
        return self._rank(rank)[1]

    def local_numel(self, rank: int) -> int:
        return self._rank(rank)[2]

    def local_bytes(self, rank: int) -> int:
        """Bytes of this rank's shard as stored (no padding)."""
        return self.local_numel(rank) * self.itemsize

    def padding_numel(self, rank: int) -> int:
        return self.padded_local_numel - self.local_numel(rank)

    # -- tensors (views, no copies) ----------------------------------------------------------------------
    def local_piece(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Shard ``rank``'s piece of ``full`` (a tensor of ``global_shape``)."""
        return self.rule.local_piece(full, self.num_shards, rank)

    def to_wire(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a shard, or a gradient of ``global_shape``) with the split dim first."""
        return self.rule.to_wire(t)

    def from_wire(self, t: torch.Tensor, contiguous: bool = False) -> torch.Tensor:
        """The inverse of ``to_wire``."""
        return self.rule.from_wire(t, contiguous)

    def unpad(self, buffer: torch.Tensor) -> torch.Tensor:
        """The unsharded tensor (``global_shape``, contiguous) viewed in a ``buffer_shape`` buffer."""
        if not (self.gathered and self.wire_is_layout):
            return buffer  # already global_shape, contiguous
        return buffer.narrow(0, 0, self.global_shape[0])


@dataclass(frozen=True)
class WirePiece:
    """One contiguous piece a rank sends in the all-gather: ``numel`` elements of ``dtype``."""

    dtype: torch.dtype
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def wire_pieces(layout: ShardLayout, wire_dtype: torch.dtype, quantizer=None, block_size: int | None = None,
                row_blocks: bool = False) -> tuple[WirePiece, ...]:
    """What one rank sends for one parameter in the group's all-gather.

    * plain: the padded local shard in ``wire_dtype`` (the compute dtype), ``padded_local_numel``
      elements.
    * quantized (``quantizer`` set: a ``perparam.quant.BlockQuantizer`` object, e.g.
      ``perparam.quant.get("nf4")``): the quantizer's pieces (e.g. codes plus one fp32 scale per block of
      ``block_size``, the quantizer's default when ``None``). Communication-only quantization tiles the
      flattened padded shard as one row (as ZeRO++'s quantized weight all-gather); stored quantization
      (``row_blocks``) tiles each dim-0 row separately, so the scales shard with the rows and do not depend on
      K.
    * replicated (``not layout.gathered``): nothing; the parameter is not all-gathered.
    """
    if not layout.gathered:
        return ()
    if quantizer is None:
        return (WirePiece(wire_dtype, layout.padded_local_numel),)
    if not callable(getattr(quantizer, "pieces", None)):
        raise TypeError(f"wire_pieces takes a quantizer object, got {quantizer!r}; look a name or codes "
                        "dtype up with perparam.quant.get(name) first")
    block_size = block_size or quantizer.default_block_size
    if row_blocks:
        return quantizer.pieces(layout.chunk, math.prod(layout.global_shape[1:]), block_size)
    return quantizer.pieces(1, layout.padded_local_numel, block_size)


@dataclass(frozen=True)
class GroupLayout:
    """The packed all-gather buffer of one ``fully_shard`` group: one collective whatever the dtypes.

    ``pieces[i]`` are parameter i's wire pieces (see ``wire_pieces``). Every rank sends ``slot_bytes``
    bytes: all pieces packed without gaps, ordered by element size, largest first, so every offset is a
    multiple of its piece's element size and ``.view(dtype)`` on the byte buffer is legal.
    ``offsets[i][j]`` is piece j of parameter i's byte offset in a rank's slot. The all-gathered buffer
    is ``num_shards * slot_bytes`` bytes, rank-major.
    """

    pieces: tuple[tuple[WirePiece, ...], ...]
    num_shards: int
    offsets: tuple[tuple[int, ...], ...] = field(init=False)
    order: tuple[tuple[int, int], ...] = field(init=False)
    slot_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        flat = [(i, j) for i, ps in enumerate(self.pieces) for j in range(len(ps))]
        order = sorted(flat, key=lambda ij: -self.pieces[ij[0]][ij[1]].dtype.itemsize)
        offsets = [[0] * len(ps) for ps in self.pieces]
        cursor = 0
        for i, j in order:
            offsets[i][j] = cursor
            cursor += self.pieces[i][j].nbytes
        object.__setattr__(self, "order", tuple(order))
        object.__setattr__(self, "offsets", tuple(tuple(o) for o in offsets))
        object.__setattr__(self, "slot_bytes", cursor)

    @classmethod
    def plain(cls, params: Sequence[ShardLayout], wire_dtypes: Sequence[torch.dtype]) -> GroupLayout:
        """The layout of unquantized sharded parameters sent in ``wire_dtypes``."""
        k = params[0].num_shards if params else 1
        return cls(tuple(wire_pieces(p, d) for p, d in zip(params, wire_dtypes)), k)

    @property
    def all_gather_bytes(self) -> int:
        """Bytes of the all-gathered buffer (what each rank holds after the collective)."""
        return self.slot_bytes * self.num_shards


def reduce_scatter_offsets(params: Sequence[ShardLayout]) -> tuple[tuple[int, ...], int]:
    """Element offsets of each parameter in one rank's reduce-scatter output, and that output's numel.

    A rank's piece holds every parameter's padded local gradient in order, then one *used* flag per
    parameter (so the ranks learn, in the same collective, which parameters any rank had a gradient for):
    ``numel = sum(padded_local_numel) + len(params)``.
    """
    offsets, cursor = [], 0
    for p in params:
        offsets.append(cursor)
        cursor += p.padded_local_numel
    return tuple(offsets), cursor + len(params)

