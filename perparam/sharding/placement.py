"""What a placement on the data-parallel shard axis means, in one place: the placement rules (a pure
function of shapes, and the few tensor moves that follow from them) and the automatic choice among them
(``ParamPolicy(placement="auto")``).

A parameter's dp placement is a torch ``Placement`` object: ``Shard(d)`` (split like
``torch.chunk(t, K, dim=d)``: every rank but the last few holds ``ceil(S[d] / K)`` slices, the last ones may
hold fewer or none) or ``Replicate()`` (every rank holds all of it; it is never all-gathered and its
gradient is all-reduced). ``rule(placement)`` is the only place that branches on the placement's type:
the layout (``perparam.sharding.layout.ShardLayout``), the runtime (``param.py``, ``group.py``),
tensor-parallel composition (``tp.py``), the policy check (``normalize``) and ``perparam plan`` ask the rule.
Adding a placement is one more rule class here (and, if ``auto`` may choose it, one more candidate below).

Shapes are the shape the dp axis splits (the parameter's, or under TP its tp-local one), in elements.
A *wire* tensor has the split dim moved to the front, so the K gathered pieces stack along dim 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def chunk_extent(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of chunk ``index`` when ``size`` slices are split like ``torch.chunk``.

    ``torch.chunk`` uses chunks of ``ceil(size / num_chunks)``; indices past the data get length 0 (their
    start is clamped to ``size``). Raises ``ValueError`` for ``num_chunks < 1`` or an index out of range.
    """
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
    if not 0 <= index < num_chunks:
        raise ValueError(f"chunk index {index} out of range for {num_chunks} chunks")
    chunk = ceil_div(size, num_chunks)
    start = min(index * chunk, size)
    return start, min(chunk, size - start)


@dataclass(frozen=True)
class ShardRule:
    """``Shard(dim)`` on a shard axis of K ranks (``dim`` already in ``[0, ndim)``)."""

    dim: int
    #: all-gathered in the group's collective, gradient reduce-scattered
    gathered = True

    @property
    def placement(self) -> Placement:
        return Shard(self.dim)

    def check(self, shape: Sequence[int]) -> None:
        if not 0 <= self.dim < len(shape):
            raise ValueError(f"Shard({self.dim}) is out of range for shape {tuple(shape)}")

    def chunk(self, shape: Sequence[int], k: int) -> int:
        """Padded extent of every rank's piece along ``dim``: ``ceil(S[dim] / K)``."""
        return ceil_div(shape[self.dim], k)

    def extent(self, shape: Sequence[int], k: int, rank: int) -> tuple[int, int]:
        return chunk_extent(shape[self.dim], k, rank)

    def _with(self, shape: Sequence[int], size: int) -> tuple[int, ...]:
        out = list(shape)
        out[self.dim] = size
        return tuple(out)

    def local_shape(self, shape: Sequence[int], k: int, rank: int) -> tuple[int, ...]:
        return self._with(shape, self.extent(shape, k, rank)[1])

    def padded_local_shape(self, shape: Sequence[int], k: int) -> tuple[int, ...]:
        return self._with(shape, self.chunk(shape, k))

    def padded_global_shape(self, shape: Sequence[int], k: int) -> tuple[int, ...]:
        return self._with(shape, self.chunk(shape, k) * k)

    def wire_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """``shape`` with ``dim`` moved to the front."""
        d = self.dim
        return (shape[d], *shape[:d], *shape[d + 1:])

    def local_piece(self, full: torch.Tensor, k: int, rank: int) -> torch.Tensor:
        """Rank ``rank``'s piece of ``full`` (a view)."""
        start, length = self.extent(full.shape, k, rank)
        return full.narrow(self.dim, start, length)

    def to_wire(self, t: torch.Tensor) -> torch.Tensor:
        return t.movedim(self.dim, 0) if self.dim != 0 else t

    def from_wire(self, t: torch.Tensor, contiguous: bool = False) -> torch.Tensor:
        if self.dim == 0:
            return t
        t = t.movedim(0, self.dim)
        return t.contiguous() if contiguous else t

    @property
    def wire_is_layout(self) -> bool:
        """The gathered pieces, stacked rank after rank, are the unsharded tensor's memory layout (dim 0);
        otherwise each piece is copied into its slices of it (``copy_out_pairs``)."""
        return self.dim == 0

    def copy_out_pairs(self, buffer: torch.Tensor, rows: torch.Tensor, first: int, k: int) -> list:
        """``(destination, source)`` views copying the all-gathered pieces ``rows`` (``[m, padded local
        numel]``, ranks ``first .. first + m - 1``, each its padded local shard in the parameter's own dim
        order, padding at the end of ``dim``) into ``buffer`` (the contiguous unsharded tensor): one pair
        for the ranks holding a full chunk, one for a rank holding less, none for empty ranks and padding.
        Each copies blocks of ``chunk * prod(shape[dim + 1:])`` contiguous elements. Views only."""
        shape, d = tuple(buffer.shape), self.dim
        chunk = self.chunk(shape, k)
        if chunk == 0 or buffer.numel() == 0:
            return []
        padded = self._with(shape, chunk)
        full_ranks = shape[d] // chunk  # ranks 0 .. full_ranks - 1 hold a whole chunk
        pairs = []
        lo, hi = first, min(first + rows.shape[0], full_ranks)
        if hi > lo:  # (pre, n, chunk, post) <- rows [n, pre, chunk, post]
            n = hi - lo
            dst = buffer.narrow(d, lo * chunk, n * chunk).unflatten(d, (n, chunk))
            pairs.append((dst, rows.narrow(0, lo - first, n).view(n, *padded).movedim(0, d)))
        if first <= full_ranks < first + rows.shape[0]:  # the one rank holding part of a chunk (if any)
            start, length = self.extent(shape, k, full_ranks)
            if length:
                src = rows[full_ranks - first].view(padded).narrow(d, 0, length)
                pairs.append((buffer.narrow(d, start, length), src))
        return pairs

    def nest(self, shape: Sequence[int], offset: Sequence[int], global_shape: Sequence[int], k: int,
             coord: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One mesh axis of ``layout.local_shape_and_offset``: chunk what the earlier axes left of ``dim``;
        an empty piece sits at the end of the dim (DTensor's convention), whatever axis emptied it."""
        d = self.dim
        start, length = chunk_extent(shape[d], k, coord)
        return self._with(shape, length), tuple(
            (o + start if length else global_shape[d]) if i == d else o for i, o in enumerate(offset))

    def under_tp(self, tp_placements: Sequence[Placement], tp_sizes: Sequence[int]) -> Placement:
        """The dp placement on the combined (dp, tp) mesh when tp already split the tensor: a
        ``_StridedShard`` when a tp axis split the same dim first (so ``full_tensor()`` stays exact)."""
        split = math.prod(n for p, n in zip(tp_placements, tp_sizes)
                          if isinstance(p, Shard) and p.dim == self.dim)
        return _StridedShard(self.dim, split_factor=split) if split > 1 else Shard(self.dim)


@dataclass(frozen=True)
class ReplicateRule:
    """``Replicate()``: every rank holds the whole parameter (0-dim parameters included)."""

    gathered = False

    @property
    def placement(self) -> Placement:
        return Replicate()

    def check(self, shape: Sequence[int]) -> None:
        pass

    def chunk(self, shape: Sequence[int], k: int) -> int:
        return shape[0] if shape else 1

    def extent(self, shape: Sequence[int], k: int, rank: int) -> tuple[int, int]:
        return 0, self.chunk(shape, k)

    def local_shape(self, shape: Sequence[int], k: int, rank: int) -> tuple[int, ...]:
        return tuple(shape)

    def padded_local_shape(self, shape: Sequence[int], k: int) -> tuple[int, ...]:
        return tuple(shape)

    def padded_global_shape(self, shape: Sequence[int], k: int) -> tuple[int, ...]:
        return tuple(shape)

    def wire_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        return tuple(shape)

    def local_piece(self, full: torch.Tensor, k: int, rank: int) -> torch.Tensor:
        return full

    def to_wire(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def from_wire(self, t: torch.Tensor, contiguous: bool = False) -> torch.Tensor:
        return t

    wire_is_layout = True

    def copy_out_pairs(self, buffer: torch.Tensor, rows: torch.Tensor, first: int, k: int) -> list:
        return [(buffer.reshape(-1), rows[0].reshape(-1))] if first == 0 and buffer.numel() else []

    def nest(self, shape: Sequence[int], offset: Sequence[int], global_shape: Sequence[int], k: int,
             coord: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return tuple(shape), tuple(offset)

    def under_tp(self, tp_placements: Sequence[Placement], tp_sizes: Sequence[int]) -> Placement:
        return Replicate()


PlacementRule = ShardRule | ReplicateRule


def rule(placement: Placement) -> PlacementRule:
    """The rule of a dp ``placement`` (``Shard(d)`` with ``d >= 0``, or ``Replicate()``).

    Raises ``ValueError`` for any other placement (``Partial``, a negative dim: ``normalize`` first)."""
    if type(placement) is Shard:
        if placement.dim < 0:
            raise ValueError(f"Shard({placement.dim}) needs a non-negative dim here; normalize it first")
        return ShardRule(placement.dim)
    if isinstance(placement, Replicate):
        return ReplicateRule()
    raise ValueError(f"placement {placement!r} is not supported on the data-parallel axis; use Shard(d) or "
                     "Replicate()")


def normalize(placement: Placement | None, ndim: int) -> Placement:
    """The concrete dp placement of a parameter of ``ndim`` dims: ``None`` means ``Shard(0)``; ``Shard(-1)``
    becomes ``Shard(ndim - 1)``. Raises ``ValueError`` (a message without the parameter's name) for a
    placement the parameter cannot take: a ``Shard`` of a 0-dim parameter (there is no dim to split: it
    needs ``Replicate()``), a dim out of range, or another placement type."""
    placement = Shard(0) if placement is None else placement
    if type(placement) is Shard:
        if ndim == 0:
            raise ValueError("is 0-dim, so it cannot be sharded on any dim (FSDP2: fully_shard doesn't "
                             "support scalar parameters); pass ParamPolicy(placement=Replicate()) for it (or "
                             "placement='auto'), or change it to a 1D tensor with numel equal to 1")
        if not -ndim <= placement.dim < ndim:
            raise ValueError(f"has {ndim} dims: placement Shard({placement.dim}) is out of range; use a dim "
                             f"in [0, {ndim - 1}]")
        return Shard(placement.dim % ndim)
    if isinstance(placement, Replicate):
        return Replicate()
    raise ValueError(f"has placement {placement!r}, which is not supported; use Shard(d), Replicate() or "
                     "'auto'")


def placement_str(placement: Placement) -> str:
    """``"Shard(1)"``, ``"Replicate()"``."""
    return f"Shard({placement.dim})" if type(placement) is Shard else "Replicate()" if isinstance(
        placement, Replicate) else str(placement)


# -- automatic placement (ParamPolicy(placement="auto")) ---------------------------------------------
#
# What DTensor expresses for one data-parallel axis of K ranks is ``Shard(d)`` on any dim ``d`` (split like
# ``torch.chunk``: the first ranks hold ``ceil(S[d] / K)`` slices, the last ones fewer or none) or
# ``Replicate()``. ``auto_placement`` picks, per parameter:
#
# * ``Replicate()`` when the parameter is at most ``replicate_below`` bytes (default
#   ``AUTO_REPLICATE_BYTES`` = 1024 bytes, e.g. a LayerNorm weight of 256 fp32 elements), like DeepSpeed's
#   ``stage3_param_persistence_threshold``: it is then never all-gathered, but every rank holds all of it
#   (and its gradient is all-reduced), so the threshold is kept small;
# * otherwise the ``Shard(d)`` with the fewest padded elements per rank, ``ceil(S[d] / K) * numel / S[d]``
#   (ties go to the lowest dim, so dim 0 when it is as good).
#
# Why a per-parameter choice is enough: under ``torch.chunk`` rank 0 always holds a full chunk of every
# sharded parameter, so the largest rank's bytes are the sum of the parameters' chunk bytes and every
# parameter's leftovers stack on the first ranks whatever the others do (DTensor has no rotated placement).
# Minimising each parameter's chunk therefore minimises the largest rank's bytes of the whole model, and
# with it the group's all-gather padding (``K * chunk - S[d]`` slices), exactly. ``Replicate()`` never
# lowers the largest rank's bytes; it only saves communicating tiny parameters.

#: Parameters of at most this many bytes (stored dtype) are replicated by ``placement="auto"``.
AUTO_REPLICATE_BYTES = 1024


def padded_local_numel(shape: Sequence[int], num_shards: int, dim: int) -> int:
    """Elements of one rank's padded shard of a ``shape`` tensor under ``Shard(dim)`` over K ranks."""
    if not shape[dim]:
        return 0
    return ceil_div(shape[dim], num_shards) * (math.prod(shape) // shape[dim])


def auto_placement(shape: Sequence[int], itemsize: int, num_shards: int, *,
                   replicate_below: int = AUTO_REPLICATE_BYTES, dims: Sequence[int] | None = None,
                   allow_replicate: bool = True) -> Placement:
    """The placement ``placement="auto"`` gives a parameter of ``shape`` (``itemsize`` bytes per element)
    on a shard axis of ``num_shards`` ranks.

    ``dims``: the tensor dims it may be sharded on (default: all). ``allow_replicate``: whether
    ``Replicate()`` may be chosen (not for quantized parameters: they are all-gathered). Units: bytes.

    A 0-dim shape gets ``Replicate()``, the only placement that holds it. Raises ``ValueError`` for
    ``num_shards < 1`` or no allowed dim.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if not shape:
        return Replicate()
    dims = list(range(len(shape))) if dims is None else list(dims)
    if not dims:
        raise ValueError("auto_placement needs at least one dim to shard on")
    if allow_replicate and math.prod(shape) * itemsize <= replicate_below:
        return Replicate()
    best = min(dims, key=lambda d: (padded_local_numel(shape, num_shards, d), d))
    return Shard(best)
