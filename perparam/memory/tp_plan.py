"""``perparam plan --tp T``: which parameters tensor parallelism splits, and the tp-local shapes the
data-parallel shard axis then splits, computed without processes.

A tensor-parallel plan is what torch's ``parallelize_module`` takes: module-name patterns (one fnmatch pattern
per dotted atom, e.g. ``"blocks.*.attn.c_attn"``) mapped to ``ColwiseParallel()`` or ``RowwiseParallel()``.
Their parameter placements on the tp axis are torch's (``torch.distributed.tensor.parallel.style``):

==================  =====================================  ======================================
module              ``ColwiseParallel``                    ``RowwiseParallel``
==================  =====================================  ======================================
``nn.Linear``       weight ``Shard(0)``, bias ``Shard(0)``  weight ``Shard(1)``, bias ``Replicate()``
``nn.Embedding``    weight ``Shard(1)``                    weight ``Shard(0)``
==================  =====================================  ======================================

Every other parameter is not tensor-parallel (a plain tensor, the same on every tp rank), as after
``parallelize_module``. ``fully_shard`` then shards each tp-local tensor over the dp shard axis
(``perparam.runtime.tp``). A tp-split dim that does not divide by T is split as DTensor splits it
(``torch.chunk``: 9 rows over T = 2 give tp rank 0 five rows and tp rank 1 four), so the tp ranks of one dp
rank may hold different bytes; ``tp_local_shape`` gives one tp rank's shape, by the function the runtime's
layout uses (``perparam.sharding.placement.chunk_extent``).

``GPT2_TP_PLAN`` is the Megatron-LM plan of the GPT-2 presets (Shoeybi et al., 2019): the attention's fused
q/k/v projection and the MLP's first projection column-parallel, the attention output and the MLP's second
projection row-parallel; embeddings, the tied output projection and the LayerNorms are not split. (Megatron
splits the fused q/k/v per head; ``ColwiseParallel`` splits its rows contiguously. The bytes are the same.)
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from perparam.sharding.placement import chunk_extent

_COLWISE = {nn.Linear: {"weight": Shard(0), "bias": Shard(0)}, nn.Embedding: {"weight": Shard(1)}}
_ROWWISE = {nn.Linear: {"weight": Shard(1), "bias": Replicate()}, nn.Embedding: {"weight": Shard(0)}}


def gpt2_tp_plan() -> dict:
    """The Megatron-LM tensor-parallel plan of ``perparam.memory.presets.GPT2`` (module patterns ->
    styles)."""
    return {"blocks.*.attn.c_attn": ColwiseParallel(), "blocks.*.attn.c_proj": RowwiseParallel(),
            "blocks.*.mlp.c_fc": ColwiseParallel(), "blocks.*.mlp.c_proj": RowwiseParallel()}


def _matches(path: str, pattern: str) -> bool:
    atoms, pats = path.split("."), pattern.split(".")
    return len(atoms) == len(pats) and all(fnmatch.fnmatchcase(a, p) for a, p in zip(atoms, pats))


def tp_placements(module: nn.Module, tp_plan: Mapping[str, object]) -> dict[str, Placement]:
    """Parameter name (as ``named_parameters`` gives it) -> its placement on the tp axis, for the
    parameters ``tp_plan`` makes tensor-parallel. Raises ``ValueError`` for a style other than
    ``ColwiseParallel``/``RowwiseParallel``, a module type they do not split here, or a pattern that
    matches no module."""
    out: dict[str, Placement] = {}
    named = dict(module.named_modules())
    for pattern, style in tp_plan.items():
        if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
            raise ValueError(f"tensor-parallel plan: '{pattern}' has style {type(style).__name__}; perparam "
                             "plan knows ColwiseParallel and RowwiseParallel")
        table = _COLWISE if isinstance(style, ColwiseParallel) else _ROWWISE
        hits = [path for path in named if path and _matches(path, pattern)]
        if not hits:
            raise ValueError(f"tensor-parallel plan: pattern '{pattern}' matches no module; fix the pattern")
        for path in hits:
            mod = named[path]
            kind = next((t for t in table if isinstance(mod, t)), None)
            if kind is None:
                raise ValueError(f"tensor-parallel plan: module '{path}' is a {type(mod).__name__}; "
                                 f"{type(style).__name__} splits nn.Linear and nn.Embedding here")
            for name, _ in mod.named_parameters(recurse=False):
                if name in table[kind]:
                    out[f"{path}.{name}"] = table[kind][name]
    return out


def tp_local_shape(shape: tuple[int, ...], placement: Placement, tp: int,
                   tp_rank: int = 0) -> tuple[int, ...]:
    """The shape tp rank ``tp_rank`` of ``tp`` holds of a parameter of ``shape`` placed ``placement``:
    DTensor's ``torch.chunk`` split (the first tp ranks hold the larger chunks, so tp rank 0 holds the
    most)."""
    if not isinstance(placement, Shard):
        return shape
    d = placement.dim
    if not 0 <= tp_rank < tp:
        raise ValueError(f"tp_rank must be in [0, {tp}), got {tp_rank}")
    return (*shape[:d], chunk_extent(shape[d], tp, tp_rank)[1], *shape[d + 1:])
