"""Block-wise quantization for the all-gather wire and for frozen stored shards.

int8: absmax per block, ``scale = amax / 127``, codes ``round(x / scale)`` in [-127, 127]; the
round-trip error is at most ``scale / 2 = amax / 254`` per element. float8_e4m3fn: ``scale = amax / 448``
(the format's largest finite value), codes ``(x / scale).to(float8_e4m3fn)``; the error is at most
``2**-4`` of ``|x|`` for normal codes (3 mantissa bits, round to nearest) and at most ``2**-10 * scale``
in the subnormal range. A block of zeros (e.g. padding of an empty shard) has scale 0 and codes 0.
As in ZeRO++ (Wang et al., 2023), quantization is block-based so one outlier spoils only its block.
"""

from __future__ import annotations

import torch

QUANT_DTYPES = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def _check(dtype: torch.dtype) -> float:
    if dtype not in QUANT_DTYPES:
        raise ValueError(f"quantization dtype must be torch.int8 or torch.float8_e4m3fn, got {dtype}")
    return QUANT_DTYPES[dtype]


def quantize_blocks(x: torch.Tensor, dtype: torch.dtype, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` (``[rows, n]``) in blocks of ``block_size`` along each row.

    Returns codes ``[rows, n]`` of ``dtype`` and fp32 scales ``[rows, ceil(n / block_size)]``.
    """
    qmax = _check(dtype)
    rows, n = x.shape
    nblocks = -(-n // block_size)
    padded = x.new_zeros(rows, nblocks * block_size, dtype=torch.float32)
    padded[:, :n] = x
    blocks = padded.view(rows, nblocks, block_size)
    scales = blocks.abs().amax(dim=2) / qmax  # [rows, nblocks]
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(2)
    scaled = blocks / safe
    if dtype == torch.int8:
        codes = scaled.round_().clamp_(-qmax, qmax).to(torch.int8)
    else:
        codes = scaled.to(dtype)
    return codes.view(rows, nblocks * block_size)[:, :n].contiguous(), scales


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, block_size: int,
                      out: torch.Tensor) -> torch.Tensor:
    """Write ``codes * scale`` (``[rows, n]``) into ``out`` (``[rows, n]``, any floating dtype)."""
    rows, n = codes.shape
    expanded = scales.repeat_interleave(block_size, dim=1)[:, :n]
    torch.mul(codes.to(torch.float32), expanded, out=out) if out.dtype == torch.float32 else out.copy_(
        codes.to(torch.float32) * expanded)
    return out
