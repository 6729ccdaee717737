"""Pure: a parameter's low-precision gradient reduce-scatter (ZeRO++'s qgZ, Wang et al., 2023) and the bytes
one rank sends for it.

``ParamPolicy(grad_quant=...)`` (DeepSpeed's ``zero_quantized_gradients``, per parameter) resolves to a
``GradQuant``: ``"bf16"`` (each piece cast to bfloat16) or a registered block quantizer (``"int8"``: absmax
codes plus one fp32 scale per ``block_size`` elements, 256 by default). The reduce-scatter of such
parameters is an all-to-all of one row per destination rank (``grad_wire``): the parameters' codes, each
parameter's piece starting on a block boundary (blocks never straddle two parameters), their fp32 scales,
then one fp32 *used* flag per parameter, unquantized. The receiving rank decodes the K rows and sums them in
the parameter's ``reduce_dtype``, in rank order (``perparam.runtime.paths.reduce_qgz``). No tensors here, so
the planner (``perparam.memory``) counts the same bytes the runtime sends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .quant import BlockQuantizer, ceil_div

#: bytes each section of a row is aligned to (the fp32 scales and flags are viewed in place)
ALIGN = 4


def _aligned(nbytes: int) -> int:
    return ceil_div(nbytes, ALIGN) * ALIGN


@dataclass(frozen=True)
class GradQuant:
    """A resolved ``ParamPolicy.grad_quant``. ``name``: ``"bf16"`` or the quantizer's registry name;
    ``quantizer``: ``None`` for ``"bf16"``; ``block_size``: elements per fp32 scale (0 for ``"bf16"``)."""

    name: str
    quantizer: BlockQuantizer | None = None
    block_size: int = 0

    def __str__(self) -> str:
        return self.name if self.quantizer is None else f"{self.name}/{self.block_size}"


#: the cast-only kind
BF16 = GradQuant("bf16")


@dataclass(frozen=True)
class GradWire:
    """One rank's row of a low-precision reduce-scatter of parameters whose padded local pieces have
    ``numels`` elements each (``ShardLayout.padded_local_numel``, equal on every rank).

    ``spans``: elements each parameter's piece takes in the encoded layout (``numels`` rounded up to a
    block). ``total``: their sum. Byte offsets in a row: codes at 0 (``codes_bytes``), scales at
    ``scales_at`` (``scales_bytes``: fp32, one per block), flags at ``flags_at`` (fp32, one per parameter);
    ``row_bytes`` in all, the same on every rank. The reduce-scatter sends ``K * row_bytes`` bytes per rank
    (its own row included, as ``CommCounter`` counts a reduce-scatter's input)."""

    numels: tuple[int, ...]
    spans: tuple[int, ...]
    total: int
    codes_bytes: int
    scales_bytes: int
    flags_bytes: int

    @property
    def scales_at(self) -> int:
        return self.codes_bytes

    @property
    def flags_at(self) -> int:
        return self.codes_bytes + self.scales_bytes

    @property
    def row_bytes(self) -> int:
        return self.flags_at + self.flags_bytes

    @property
    def blocked(self) -> bool:
        """Some piece was padded to a block boundary: the encoded layout differs from the packed one."""
        return self.spans != self.numels


def grad_wire(numels: Sequence[int], gq: GradQuant) -> GradWire:
    """The row layout for pieces of ``numels`` elements sent as ``gq`` (see ``GradWire``)."""
    numels = tuple(numels)
    q = gq.quantizer
    if q is None:  # bf16: two bytes per element, no scales
        return GradWire(numels, numels, sum(numels), _aligned(2 * sum(numels)), 0, 4 * len(numels))
    spans = tuple(ceil_div(n, gq.block_size) * gq.block_size for n in numels)
    total = sum(spans)
    codes = _aligned(q.codes_per_row(total) * q.codes_dtype.itemsize)
    return GradWire(numels, spans, total, codes, 4 * (total // gq.block_size), 4 * len(numels))


def wire_bytes(numels: Sequence[int], gq: GradQuant | None, reduce_dtype: torch.dtype) -> int:
    """Bytes one rank sends in the reduce-scatter of pieces of ``numels`` elements (``K`` pieces each:
    multiply by K), flags included: ``grad_wire(...).row_bytes`` for a ``gq``, else the reduce dtype's
    ``(sum(numels) + len(numels)) * itemsize`` (``perparam.sharding.layout.reduce_scatter_offsets``)."""
    if gq is None:
        return (sum(numels) + len(numels)) * reduce_dtype.itemsize
    return grad_wire(numels, gq).row_bytes
