"""The int8 absmax block codec's kernels, shared by ``Int8Quantizer`` (the int8 all-gather, stored int8
shards) and qgZ's int8 gradient reduce-scatter (``perparam.runtime.paths.reduce_qgz``).

Codes are ``round(x / s)`` (half to even, ``torch.round``) with ``s = amax / 127`` per block of ``block_size``
values; a block of zeros has ``s = 0`` and codes 0. Encoding is three vectorised passes after the absmax:
the division written to a scratch (from the values where they lie: no copy of them first), ``round_`` in
place, and the narrowing copy to int8 straight into the codes' destination (the send buffer's rows).
Decoding is a widening copy into fp32, a multiply by each block's scale and, for a sum over ranks, the
additions in rank order. Fused alternatives were slower or round differently (each pass's time:
``grad_quant_codec`` in ``benchmarks/README.md``): ``addcdiv`` with the 1.5 * 2**23 rounding trick (not
vectorised with two broadcast operands), ``quantize_per_channel`` (a scalar loop, and it multiplies by the
reciprocal), ``addcmul_`` for the decode (one rounding instead of two: not bitwise).

No tensor is allocated at import.
"""

from __future__ import annotations

import torch


def absmax(blocks: torch.Tensor) -> torch.Tensor:
    """``[..., nblocks, block_size]`` -> ``[..., nblocks]``: the largest magnitude of each block (fp32; +0.0
    for a block of zeros whatever their signs). NaN when the block holds a NaN."""
    # amax and amin apart: two vectorised reductions, faster than torch.aminmax, abs().amax (which writes a
    # temporary of the blocks' size) and linalg.vector_norm(inf): grad_quant_codec in benchmarks/README.md.
    # abs_(): which of -0.0 and +0.0 the reductions return depends on the vector lanes (the alignment)
    return torch.maximum(blocks.amax(dim=-1), blocks.amin(dim=-1).neg_()).abs_()


def safe_divisor(scales: torch.Tensor) -> torch.Tensor:
    """``[..., nblocks]`` scales -> ``[..., nblocks, 1]`` divisors: the scale, or 1 for a block of zeros."""
    return torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(-1)


def encode_blocks(blocks: torch.Tensor, divisor: torch.Tensor, codes: torch.Tensor,
                  scratch: torch.Tensor | None = None) -> None:
    """Write ``round(blocks / divisor)`` as int8 into ``codes``.

    ``blocks``: fp32 ``[rows, nblocks, block_size]`` (any strides); ``divisor``: ``[rows, nblocks, 1]``
    (``safe_divisor``: then every quotient lies in [-127, 127] up to one rounding, so no clamp is needed);
    ``codes``: int8 ``[rows, m]`` with ``m <= nblocks * block_size`` (the first ``m`` codes of each row are
    written; any row stride, e.g. a section of the send buffer's rows); ``scratch``: fp32 of ``blocks``'s
    shape for the quotients (``blocks`` itself to work in place, overwriting it; a new tensor when ``None``).
    """
    rows, nblocks, block_size = blocks.shape
    if codes.numel() == 0:
        return
    if scratch is None:
        scratch = torch.empty(blocks.shape, dtype=torch.float32, device=blocks.device)
    torch.div(blocks, divisor, out=scratch).round_()
    codes.copy_(scratch.view(rows, nblocks * block_size).narrow(1, 0, codes.shape[1]))


def decode_blocks(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (fp32 ``[rows, nblocks, block_size]``, any strides) = ``codes`` (int8 ``[rows, nblocks *
    block_size]``) times each block's scale (``scales``: ``[rows, nblocks]``); returns ``out``. Each
    product is rounded once, as ``codes.float() * scale``."""
    out.view(codes.shape).copy_(codes)
    return out.mul_(scales.unsqueeze(-1))


def decode_sum_blocks(codes: torch.Tensor, scales: torch.Tensor, scratch: torch.Tensor,
                      out: torch.Tensor) -> torch.Tensor:
    """The sum over ranks, in rank order, of the decoded rows: ``out`` (fp32 ``[nblocks, block_size]``) =
    ``codes[0] * scales[0] + codes[1] * scales[1] + ...``, each product rounded to fp32, then each addition.

    ``codes``: int8 ``[K, nblocks * block_size]`` (any row stride); ``scales``: fp32 ``[K, nblocks]``;
    ``scratch``: fp32 ``[K, nblocks * block_size]`` (overwritten). Returns ``out``."""
    k = codes.shape[0]
    nblocks, block_size = out.shape
    values = decode_blocks(codes, scales, scratch.view(k, nblocks, block_size))
    if k == 1:
        return out.copy_(values[0])
    torch.add(values[0], values[1], out=out)
    for r in range(2, k):
        out.add_(values[r])
    return out
