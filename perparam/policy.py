"""Policies: the call's mixed-precision defaults and per-parameter overrides.

``MixedPrecisionPolicy`` has FSDP2's fields and meaning, so an FSDP2 user can switch. ``ParamPolicy``
overrides them for single parameters; ``None`` in any field inherits the call's value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import Placement


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of a ``fully_shard`` call.

    ``param_dtype``: dtype of the all-gathered parameters used in forward and backward (``None``: keep the
    stored dtype). ``reduce_dtype``: dtype in which gradients are reduce-scattered (``None``: the
    ``param_dtype``, else the stored dtype). ``output_dtype``: forward outputs are cast to it (``None``: no
    cast). ``cast_forward_inputs``: cast floating-point forward inputs to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class QuantPolicy:
    """Block-wise quantization of a parameter's all-gather, and optionally of its stored shard.

    ``dtype``: ``torch.int8`` (absmax, 127 levels) or ``torch.float8_e4m3fn``. ``block_size``: elements
    per scale. ``store_quantized``: keep a frozen parameter's shard quantized (about 1 byte per element
    plus one fp32 scale per block) instead of communicating only.
    """

    dtype: torch.dtype = torch.int8
    block_size: int = 256
    store_quantized: bool = False


@dataclass(frozen=True)
class ParamPolicy:
    """Per-parameter overrides; ``None`` inherits from the call's ``MixedPrecisionPolicy`` and state."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    requires_grad: bool | None = None
    quant: QuantPolicy | None = None
    placement: Placement | None = None
