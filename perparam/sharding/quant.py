"""The quantizer protocol: how one parameter's shard is block-quantized on the all-gather wire and, for a
frozen parameter, in storage; a registry by name; and the int8 and fp8 quantizers.

A quantizer (a ``BlockQuantizer``) works on a matrix ``x`` of ``[rows, n]`` values whose rows are tiled, each
on its own, in blocks of ``block_size`` elements with one fp32 scale per block (the last block of a row may be
short):

* communication-only quantization quantizes each rank's flattened padded shard as one row
  (``rows = 1``, ``n = padded_local_numel``, as ZeRO++'s quantized weight all-gather, Wang et al., 2023),
* stored quantization quantizes each dim-0 row of the shard (``rows = chunk``, ``n`` = the product of
  the other dims), so the scales shard with the rows and do not depend on the number of ranks.

Its methods, per parameter, in the spirit of FSDP2's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``:

* ``pieces(rows, n, block_size)``: the wire pieces one rank sends (``WirePiece``: dtype + numel each).
  Pure: no tensors, so ``layout.wire_pieces`` (and a memory planner) can call it without processes.
* ``pack(x, block_size)``: the pieces' tensors for ``x`` (``[rows, n]``, any floating dtype), each
  ``[rows, numel per row]``, in the order and sizes of ``pieces``.
* ``unpack(pieces, block_size, out)``: dequantize pieces of ``[rows, numel per row]`` (e.g. the K ranks'
  gathered pieces) into ``out`` (``[rows, n]``, the compute dtype).
* ``error_bound(amax)``: the largest ``|unpack(pack(x)) - x|`` of any element of a block whose largest
  magnitude is ``amax`` (elementwise over a tensor of block absmaxes).

Stored quantization keeps piece 0 (the codes, shaped ``stored_shape(global_shape)``) as the sharded
parameter and piece 1 (fp32 scales ``[rows, blocks per row]``) as the ``<name>_qscale`` buffer, so a
quantizer used with ``store_quantized=True`` has exactly these two pieces (the ``BlockQuantizer`` base).

To add a quantizer: subclass ``BlockQuantizer``: set ``codes_dtype`` and ``default_block_size``;
implement ``encode`` (a ``[rows, blocks, block_size]`` tensor to one code per value and the scales),
``decode`` (codes to unscaled values) and ``error_bound``; override ``codes_per_row`` and ``pack_codes``
if several codes share an element. Then ``perparam.quant.register("name", instance)`` and
``QuantPolicy("name")`` uses it (``perparam/sharding/quant_nf4.py`` is a complete example). A block of zeros
(e.g. the padding of an empty shard) has scale 0 and unpacks to zeros in every quantizer here.
"""

from __future__ import annotations

import math
from types import MappingProxyType

import torch

from . import int8_codec
from .layout import WirePiece


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class BlockQuantizer:
    """Absmax block quantization: codes (``codes_dtype``) plus one fp32 scale per block of each row.

    ``name``: the registry name. ``default_block_size``: elements per scale when ``QuantPolicy`` gives
    none. Subclasses implement ``encode``, ``decode`` and ``error_bound``.
    """

    name: str = ""
    codes_dtype: torch.dtype = torch.int8
    default_block_size: int = 256

    # -- pure sizes ------------------------------------------------------------------------------------
    def codes_per_row(self, n: int) -> int:
        """Elements of ``codes_dtype`` holding the codes of a row of ``n`` values (1 per value)."""
        return n

    def pieces(self, rows: int, n: int, block_size: int) -> tuple[WirePiece, ...]:
        """The pieces of a ``[rows, n]`` matrix: codes, then fp32 scales (``rows * ceil(n / block_size)``)."""
        return (WirePiece(self.codes_dtype, rows * self.codes_per_row(n)),
                WirePiece(torch.float32, rows * ceil_div(n, block_size)))

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of the stored codes of a parameter of ``shape`` (2+ dims, quantized per dim-0 row):
        ``shape`` itself for one code per element, else ``(shape[0], codes_per_row(prod(shape[1:])))``."""
        n = math.prod(shape[1:])
        cpr = self.codes_per_row(n)
        return tuple(shape) if cpr == n else (shape[0], cpr)

    # -- tensors ---------------------------------------------------------------------------------------
    def pack(self, x: torch.Tensor, block_size: int) -> list[torch.Tensor]:
        """Quantize ``x`` (``[rows, n]``): ``[codes [rows, codes_per_row(n)], scales [rows, blocks]]``."""
        rows, n = x.shape
        nblocks = ceil_div(n, block_size)
        padded = torch.zeros(rows, nblocks * block_size, dtype=torch.float32, device=x.device)
        padded[:, :n] = x
        blocks = padded.view(rows, nblocks, block_size)
        amax = blocks.abs().amax(dim=2)  # [rows, nblocks]
        codes, scales = self.encode(blocks, amax)
        return [self.pack_codes(codes.reshape(rows, nblocks * block_size)[:, :n]), scales]

    def pack_into(self, x: torch.Tensor, block_size: int, outs: list[torch.Tensor],
                  overwrite: bool = False) -> None:
        """``pack(x, block_size)`` written into ``outs`` (one tensor per piece, of the piece's dtype and
        numel, any shape, e.g. slices of the all-gather's send buffer). ``overwrite``: ``x`` is scratch the
        quantizer may overwrite (a quantizer that can writes its codes straight into ``outs``)."""
        for out, piece in zip(outs, self.pack(x, block_size)):
            out.view(-1)[:piece.numel()].copy_(piece.reshape(-1))

    def unpack(self, pieces: list[torch.Tensor], block_size: int, out: torch.Tensor) -> torch.Tensor:
        """Write the dequantized ``[rows, n]`` values of ``pieces`` (codes ``[rows, codes_per_row(n)]``,
        scales ``[rows, blocks]``; any shapes with those numels) into ``out`` and return it."""
        rows, n = out.shape
        codes = pieces[0].reshape(rows, self.codes_per_row(n))
        scales = pieces[1].reshape(rows, ceil_div(n, block_size)).to(torch.float32)
        values = self.decode(codes, n)  # [rows, n] fp32, not yet scaled
        expanded = scales.repeat_interleave(block_size, dim=1)[:, :n]
        if out.dtype == torch.float32:
            return torch.mul(values, expanded, out=out)
        return out.copy_(values * expanded)

    def encode(self, blocks: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``blocks`` ``[rows, nblocks, block_size]`` fp32 (zero-padded), ``amax`` ``[rows, nblocks]``:
        one code per value ``[rows, nblocks, block_size]`` and the scales ``[rows, nblocks]`` fp32."""
        raise NotImplementedError

    def pack_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """One code per value ``[rows, n]`` to the stored codes ``[rows, codes_per_row(n)]``."""
        return codes.contiguous()

    def decode(self, codes: torch.Tensor, n: int) -> torch.Tensor:
        """Codes ``[rows, codes_per_row(n)]`` to the unscaled values ``[rows, n]`` (fp32)."""
        raise NotImplementedError

    def error_bound(self, amax: torch.Tensor) -> torch.Tensor:
        """Largest absolute round-trip error of an element of a block with absmax ``amax``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class _ScaledCast(BlockQuantizer):
    """One code per element: ``scale = amax / qmax``, code = ``x / scale`` rounded into ``codes_dtype``."""

    qmax: float = 127.0

    def encode(self, blocks, amax):
        scales = amax / self.qmax
        safe = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(2)
        return self._round(blocks / safe), scales

    def decode(self, codes, n):
        return codes.to(torch.float32)

    def _round(self, scaled: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Int8Quantizer(_ScaledCast):
    """int8 absmax: ``scale = amax / 127``, codes ``round(x / scale)`` in [-127, 127]. Rounding to the
    nearest integer errs by at most half a step: ``error_bound = scale / 2 = amax / 254``.

    ``pack``/``pack_into``/``unpack`` run ``perparam.sharding.int8_codec``'s kernels (bitwise the codes and
    values of ``encode``/``decode``): no padded copy unless a row ends in a short block, the codes straight
    into the destination, decoded in place in ``out``."""

    name, codes_dtype, qmax = "int8", torch.int8, 127.0

    def pack(self, x, block_size):
        rows, n = x.shape
        outs = [torch.empty(rows, n, dtype=torch.int8, device=x.device),
                torch.empty(rows, ceil_div(n, block_size), dtype=torch.float32, device=x.device)]
        self.pack_into(x, block_size, outs, overwrite=False)
        return outs

    def pack_into(self, x, block_size, outs, overwrite=False):
        rows, n = x.shape
        if rows * n == 0:
            return
        nblocks = ceil_div(n, block_size)
        if n % block_size == 0 and x.dtype == torch.float32 and x.is_contiguous():
            blocks = x.view(rows, nblocks, block_size)
            scratch = blocks if overwrite else None
        else:  # zero-padded to whole blocks (a copy: ours to overwrite)
            blocks = torch.zeros(rows, nblocks * block_size, dtype=torch.float32, device=x.device)
            blocks[:, :n] = x
            blocks = scratch = blocks.view(rows, nblocks, block_size)
        scales = torch.div(int8_codec.absmax(blocks), self.qmax, out=outs[1].view(rows, nblocks))
        int8_codec.encode_blocks(blocks, int8_codec.safe_divisor(scales), outs[0].view(rows, n), scratch)

    def unpack(self, pieces, block_size, out):
        rows, n = out.shape
        if rows * n == 0:
            return out
        nblocks, full = ceil_div(n, block_size), n // block_size * block_size
        codes = pieces[0].reshape(rows, n)
        scales = pieces[1].reshape(rows, nblocks).to(torch.float32)
        direct = out.dtype == torch.float32 and out.stride(1) == 1 and out.stride(0) >= n
        target = out if direct else torch.empty(rows, n, dtype=torch.float32, device=out.device)
        if full:
            int8_codec.decode_blocks(codes[:, :full], scales[:, :full // block_size],
                                     target[:, :full].view(rows, -1, block_size))
        if full < n:  # the last, short block of each row
            torch.mul(codes[:, full:], scales[:, -1:], out=target[:, full:])
        return out if direct else out.copy_(target)

    def _round(self, scaled):
        return scaled.round_().clamp_(-self.qmax, self.qmax).to(torch.int8)

    def error_bound(self, amax):
        return amax / 254


class Fp8Quantizer(_ScaledCast):
    """float8_e4m3fn: ``scale = amax / 448`` (the format's largest finite value), codes
    ``(x / scale).to(float8_e4m3fn)``. With 3 mantissa bits and round-to-nearest the error is at most
    ``2**-4 * |x|`` for normal codes and ``2**-10 * scale`` in the subnormal range (OCP FP8 spec, 2023),
    so over a block ``error_bound = amax * (2**-4 + 2**-10 / 448)``."""

    name, codes_dtype, qmax = "fp8", torch.float8_e4m3fn, 448.0

    def _round(self, scaled):
        return scaled.to(torch.float8_e4m3fn)

    def error_bound(self, amax):
        return amax * (2**-4 + 2**-10 / 448)


# -- registry --------------------------------------------------------------------------------------------
_REGISTRY: dict[str, BlockQuantizer] = {}
#: ``QuantPolicy(dtype=...)`` of earlier versions: the codes dtype names the quantizer
_BY_DTYPE = MappingProxyType({torch.int8: "int8", torch.float8_e4m3fn: "fp8"})


def register(name: str, quantizer: BlockQuantizer) -> BlockQuantizer:
    """Make ``quantizer`` available as ``QuantPolicy(name)``; returns it. Raises ``ValueError`` when
    ``name`` is taken by another quantizer."""
    if _REGISTRY.get(name, quantizer) is not quantizer:
        raise ValueError(f"quantizer name {name!r} is already registered to {_REGISTRY[name]!r}; pick "
                         "another")
    _REGISTRY[name] = quantizer
    return quantizer


def names() -> list[str]:
    return sorted(_REGISTRY)


def get(key: str | torch.dtype | BlockQuantizer) -> BlockQuantizer:
    """The quantizer registered as ``key`` (a name, or ``torch.int8`` / ``torch.float8_e4m3fn`` for
    backward compatibility; a quantizer object is returned as is). Raises ``KeyError`` naming the
    registered names."""
    if isinstance(key, BlockQuantizer):
        return key
    name = _BY_DTYPE.get(key, key) if isinstance(key, torch.dtype) else key
    if not isinstance(name, str) or name not in _REGISTRY:
        raise KeyError(f"no quantizer {key!r}; registered: {', '.join(names())} "
                       "(add one with perparam.quant.register(name, quantizer))")
    return _REGISTRY[name]


register("int8", Int8Quantizer())
register("fp8", Fp8Quantizer())


# -- the functions of earlier versions, through the protocol ----------------------------------------------
def quantize_blocks(x: torch.Tensor, dtype: torch.dtype,
                    block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` (``[rows, n]``) in blocks of ``block_size`` along each row with the quantizer of
    ``dtype`` (``torch.int8`` or ``torch.float8_e4m3fn``): codes ``[rows, n]`` of ``dtype`` and fp32
    scales ``[rows, ceil(n / block_size)]``. Raises ``ValueError`` for another dtype."""
    if dtype not in _BY_DTYPE:
        raise ValueError(f"quantization dtype must be torch.int8 or torch.float8_e4m3fn, got {dtype}")
    codes, scales = get(dtype).pack(x, block_size)
    return codes, scales


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, block_size: int,
                      out: torch.Tensor) -> torch.Tensor:
    """Write ``codes * scale`` (``[rows, n]``, int8 or float8_e4m3fn codes) into ``out`` (``[rows, n]``)."""
    return get(codes.dtype).unpack([codes, scales], block_size, out)
