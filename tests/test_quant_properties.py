"""Property tests of block quantization and of packing mixed wire pieces into one all-gather buffer."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from perparam import quant
from perparam.quant import dequantize_blocks, quantize_blocks
from perparam.sharding.layout import GroupLayout, WirePiece
from tests.quant_cases import block_amax, matrix_case

pytestmark = pytest.mark.fast


@settings(max_examples=300, deadline=None)
@given(matrix_case())
def test_int8_round_trip_error_is_at_most_amax_over_254(case):
    x, block = case
    codes, scales = quantize_blocks(x, torch.int8, block)
    assert codes.dtype == torch.int8 and codes.shape == x.shape
    assert scales.shape == (x.shape[0], -(-x.shape[1] // block))
    out = dequantize_blocks(codes, scales, block, out=torch.empty_like(x))
    bound = block_amax(x, block) / 254
    assert torch.all((out - x).abs() <= bound * (1 + 1e-5) + 1e-30)


@settings(max_examples=300, deadline=None)
@given(matrix_case())
def test_fp8_round_trip_stays_within_its_relative_bound(case):
    x, block = case
    codes, scales = quantize_blocks(x, torch.float8_e4m3fn, block)
    out = dequantize_blocks(codes, scales, block, out=torch.empty_like(x))
    scale = block_amax(x, block) / 448
    # 3 mantissa bits: half an ulp is 2**-4 of |x| for normal codes, 2**-10 * scale below 2**-6
    bound = x.abs() * 2**-4 + scale * 2**-10
    assert torch.all((out - x).abs() <= bound * (1 + 1e-5) + 1e-30)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 5), st.integers(1, 9))
def test_an_empty_block_has_scale_zero(rows, block):
    codes, scales = quantize_blocks(torch.zeros(rows, 3 * block), torch.int8, block)
    assert torch.all(scales == 0) and torch.all(codes == 0)


def _int8_reference(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 codec as a formula: ``round(x / (amax / 127))`` per zero-padded block (a block of zeros:
    scale 0, codes 0)."""
    rows, n = x.shape
    nb = -(-n // block)
    padded = torch.zeros(rows, nb * block)
    padded[:, :n] = x
    blocks = padded.view(rows, nb, block)
    scales = blocks.abs().amax(dim=2) / 127
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(2)
    return (blocks / safe).round().to(torch.int8).view(rows, nb * block)[:, :n], scales


@settings(max_examples=100, deadline=None)
@given(matrix_case(), st.sampled_from([torch.float32, torch.bfloat16]))
def test_int8_codec_in_few_passes_gives_bitwise_the_codes_and_values_of_its_formula(case, out_dtype):
    x, block = case
    q = quant.get("int8")
    codes, scales = q.pack(x, block)
    want_codes, want_scales = _int8_reference(x, block)
    assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)
    out = q.unpack([codes.reshape(-1), scales.reshape(-1)], block, out=torch.empty(x.shape, dtype=out_dtype))
    expanded = scales.repeat_interleave(block, dim=1)[:, :x.shape[1]]
    assert torch.equal(out, (codes.float() * expanded).to(out_dtype))
    if x.shape[1] % block == 0 and x.numel():  # quantized in place into given outputs (the send buffer)
        scratch, outs = x.clone(), [torch.empty(x.numel(), dtype=torch.int8), torch.empty(scales.numel())]
        q.pack_into(scratch, block, outs, overwrite=True)
        assert torch.equal(outs[0], codes.reshape(-1)) and torch.equal(outs[1], scales.reshape(-1))


def test_int8_codes_round_half_to_even_as_torch_round():
    x = torch.tensor([[254.0, 1.0, 3.0, 5.0, -1.0, -3.0, -5.0, 253.0]])  # scale 2: x / 2 has halves
    codes, scales = quant.get("int8").pack(x, 8)
    assert scales.tolist() == [[2.0]]
    assert codes.tolist() == [[127, 0, 2, 2, 0, -2, -2, 126]]


PIECE_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8,
                torch.float8_e4m3fn]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6),
       st.lists(st.lists(st.tuples(st.sampled_from(PIECE_DTYPES), st.integers(0, 20)),
                         min_size=0, max_size=3), min_size=0, max_size=6),
       st.integers(0, 99))
def test_packing_any_mix_of_pieces_into_one_buffer_round_trips_exactly(k, spec, seed):
    pieces = tuple(tuple(WirePiece(d, n) for d, n in param) for param in spec)
    layout = GroupLayout(pieces, k)
    g = torch.Generator().manual_seed(seed)
    data = [[[torch.randint(0, 256, (p.nbytes,), dtype=torch.uint8, generator=g) for p in ps]
             for ps in pieces]
            for _ in range(k)]
    gathered = torch.zeros(k, layout.slot_bytes, dtype=torch.uint8)
    covered = torch.zeros(layout.slot_bytes, dtype=torch.int32)
    for (i, j) in layout.order:
        off, piece = layout.offsets[i][j], pieces[i][j]
        assert off % piece.dtype.itemsize == 0
        covered[off:off + piece.nbytes] += 1
        for rank in range(k):
            gathered[rank, off:off + piece.nbytes] = data[rank][i][j]
    assert torch.all(covered == 1)  # no gaps, no overlaps
    out = gathered.reshape(-1).view(k, layout.slot_bytes)
    for rank in range(k):
        for i, ps in enumerate(pieces):
            for j, piece in enumerate(ps):
                raw = out[rank, layout.offsets[i][j]:layout.offsets[i][j] + piece.nbytes]
                assert torch.equal(raw, data[rank][i][j])
                assert raw.clone().view(piece.dtype).numel() == piece.numel  # copied out, as the runtime does
