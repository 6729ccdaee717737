"""Automatic per-parameter placement (``ParamPolicy(placement="auto")``), as a pure function of shapes.

What DTensor expresses for one data-parallel axis of K ranks is ``Shard(d)`` on any dim ``d`` (split like
``torch.chunk``: the first ranks hold ``ceil(S[d] / K)`` slices, the last ones fewer or none) or
``Replicate()``. ``auto_placement`` picks, per parameter:

* ``Replicate()`` when the parameter is at most ``replicate_below`` bytes (default
  ``AUTO_REPLICATE_BYTES`` = 1024 bytes, e.g. a LayerNorm weight of 256 fp32 elements), like DeepSpeed's
  ``stage3_param_persistence_threshold``: it is then never all-gathered, but every rank holds all of it
  (and its gradient is all-reduced), so the threshold is kept small;
* otherwise the ``Shard(d)`` with the fewest padded elements per rank, ``ceil(S[d] / K) * numel / S[d]``
  (ties go to the lowest dim, so dim 0 when it is as good).

Why a per-parameter choice is enough: under ``torch.chunk`` rank 0 always holds a full chunk of every
sharded parameter, so the largest rank's bytes are the sum of the parameters' chunk bytes and every
parameter's leftovers stack on the first ranks whatever the others do (DTensor has no rotated placement).
Minimising each parameter's chunk therefore minimises the largest rank's bytes of the whole model, and
with it the group's all-gather padding (``K * chunk - S[d]`` slices), exactly. ``Replicate()`` never
lowers the largest rank's bytes; it only saves communicating tiny parameters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch.distributed.tensor import Placement, Replicate, Shard

from .layout import ceil_div

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

    Raises ``ValueError`` for a 0-dim shape (it cannot be sharded), ``num_shards < 1`` or no allowed dim.
    """
    if not shape:
        raise ValueError("a 0-dim parameter cannot be sharded on any dim")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    dims = list(range(len(shape))) if dims is None else list(dims)
    if not dims:
        raise ValueError("auto_placement needs at least one dim to shard on")
    if allow_replicate and math.prod(shape) * itemsize <= replicate_below:
        return Replicate()
    best = min(dims, key=lambda d: (padded_local_numel(shape, num_shards, d), d))
    return Shard(best)
