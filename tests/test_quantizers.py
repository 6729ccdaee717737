"""The quantizer protocol (``perparam.quant``) for every registered quantizer, NF4's levels and packing,
and ``QuantPolicy``'s resolution by name (one process, no collectives)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from torch import nn
from torch.distributed.tensor import Shard

from perparam import MixedPrecisionPolicy, ParamPolicy, PolicyError, QuantPolicy, quant
from perparam.sharding.layout import ShardLayout, wire_pieces
from perparam.sharding.policy import resolve
from perparam.sharding.quant_nf4 import NF4_HALF_MAX_GAP, NF4_LEVELS
from tests.quant_cases import block_amax, matrix_case

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("name", quant.names())
@settings(max_examples=150, deadline=None)
@given(case=matrix_case())
def test_every_quantizer_packs_its_stated_pieces_and_round_trips_within_its_bound(name, case):
    q = quant.get(name)
    x, block = case
    rows, n = x.shape
    want = q.pieces(rows, n, block)
    packed = q.pack(x, block)
    assert [(t.dtype, t.numel()) for t in packed] == [(p.dtype, p.numel) for p in want]
    assert [t.shape[0] for t in packed] == [rows] * len(packed)  # one row of pieces per row of values
    out = q.unpack([t.reshape(-1) for t in packed], block, out=torch.full((rows, n), float("nan")))
    bound = q.error_bound(block_amax(x, block))
    assert torch.all((out - x).abs() <= bound * (1 + 1e-5) + 1e-30), name
    assert torch.all(out[block_amax(x, block) == 0] == 0)  # an all-zero block (padding) unpacks to zeros


@pytest.mark.parametrize("name", quant.names())
def test_every_quantizer_handles_empty_shards_and_bf16_outputs(name):
    q = quant.get(name)
    for rows, n in [(0, 7), (3, 0), (0, 0)]:
        packed = q.pack(torch.zeros(rows, n), 64)
        assert [t.numel() for t in packed] == [p.numel for p in q.pieces(rows, n, 64)]
        assert q.unpack(packed, 64, out=torch.empty(rows, n)).shape == (rows, n)
    x = torch.randn(2, 70)
    out = q.unpack(q.pack(x, 64), 64, out=torch.empty(2, 70, dtype=torch.bfloat16))
    assert torch.all((out.float() - x).abs() <= q.error_bound(block_amax(x, 64)) + x.abs() * 2**-8)


def test_nf4_levels_bound_and_packing():
    assert len(NF4_LEVELS) == 16 and list(NF4_LEVELS) == sorted(NF4_LEVELS)
    assert (NF4_LEVELS[0], NF4_LEVELS[7], NF4_LEVELS[15]) == (-1.0, 0.0, 1.0)  # exact: -1, 0 and 1
    assert (NF4_HALF_MAX_GAP == pytest.approx((NF4_LEVELS[1] - NF4_LEVELS[0]) / 2)
            == pytest.approx(0.1519, abs=1e-4))
    q = quant.get("nf4")
    levels = torch.tensor(NF4_LEVELS)
    codes, scales = q.pack(levels.view(1, 16) * 3.0, 64)  # every level once, in order: codes 0..15
    assert codes.dtype == torch.uint8 and codes.tolist() == [[0x01, 0x23, 0x45, 0x67, 0x89, 0xAB, 0xCD, 0xEF]]
    assert scales.tolist() == [[3.0]]
    assert torch.equal(q.unpack([codes, scales], 64, out=torch.empty(1, 16)), levels.view(1, 16) * 3.0)
    # an odd row: 3 codes in 2 bytes, the last low nibble padding
    assert q.pieces(1, 3, 64)[0].numel == 2 and q.pack(torch.ones(1, 3), 64)[0].shape == (1, 2)
    assert q.stored_shape((256, 256)) == (256, 128) and q.stored_shape((4, 3, 5)) == (4, 8)
    assert quant.get("int8").stored_shape((4, 3, 5)) == (4, 3, 5)


def test_nf4_stored_bytes_are_under_0_15x_fp32():
    """256 x 256 stored as NF4: 0.5 B/element codes + 4/64 B/element scales = 0.140625x fp32."""
    layout = ShardLayout((256, 256), torch.uint8, 2, Shard(0))
    pieces = wire_pieces(layout, torch.float32, quant.get("nf4"), row_blocks=True)
    assert sum(p.nbytes for p in pieces) == 128 * 128 + 128 * 4 * 4 == 0.140625 * 128 * 256 * 4
    # communication only: the flat shard, blocks of 64
    comm = wire_pieces(layout, torch.float32, quant.get("nf4"))
    assert [(p.dtype, p.numel) for p in comm] == [(torch.uint8, 128 * 128), (torch.float32, 128 * 256 // 64)]


def test_registry_refuses_a_taken_name_and_names_the_registered_ones():
    assert quant.get(torch.int8) is quant.get("int8") and quant.get(torch.float8_e4m3fn) is quant.get("fp8")
    with pytest.raises(ValueError, match="already registered"):
        quant.register("nf4", quant.Int8Quantizer())
    with pytest.raises(KeyError, match="int8, nf4"):
        quant.get("nf5")


def _resolve(qp: QuantPolicy, shape=(8, 4)):
    p = nn.Parameter(torch.zeros(shape), requires_grad=False)
    return resolve("layer.weight", p, MixedPrecisionPolicy(), ParamPolicy(quant=qp), len(shape)).quant


def test_quant_policy_takes_a_name_or_the_earlier_dtypes():
    assert _resolve(QuantPolicy("nf4")) == QuantPolicy(quant.get("nf4"), 64, False, torch.uint8)
    assert _resolve(QuantPolicy()) == QuantPolicy(quant.get("int8"), 256, False, torch.int8)
    assert _resolve(QuantPolicy(dtype=torch.float8_e4m3fn)).quantizer is quant.get("fp8")
    old = _resolve(QuantPolicy(torch.int8, 16, store_quantized=True))
    assert (old.quantizer, old.block_size, old.store_quantized) == (quant.get("int8"), 16, True)


@pytest.mark.parametrize("qp, fragments", [
    (QuantPolicy("nf5"), ["'layer.weight'", "'nf5'", "nf4", "perparam.quant.register"]),
    (QuantPolicy("nf4", dtype=torch.int8), ["'layer.weight'", "torch.uint8", "drop dtype"]),
    (QuantPolicy("nf4", block_size=0), ["'layer.weight'", "block_size", ">= 1"]),
])
def test_bad_quant_policies_name_the_parameter_and_the_fix(qp, fragments):
    with pytest.raises(PolicyError) as info:
        _resolve(qp)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_wire_pieces_stay_pure_for_any_registered_quantizer():
    for name in quant.names():
        q = quant.get(name)
        layout = ShardLayout((5, 7), q.codes_dtype, 3, Shard(0))  # chunk 2: rank 2 holds 1 row
        pieces = wire_pieces(layout, torch.float32, q)
        assert pieces == q.pieces(1, 14, q.default_block_size)
        assert wire_pieces(layout, torch.float32, q, row_blocks=True) == q.pieces(2, 7, q.default_block_size)
        assert math.prod(q.stored_shape((5, 7))) == 5 * q.codes_per_row(7)


def test_wire_pieces_refuses_a_quantizer_name_and_says_to_look_it_up():
    layout = ShardLayout((5, 7), torch.float32, 3, Shard(0))
    with pytest.raises(TypeError, match=r"perparam\.quant\.get"):
        wire_pieces(layout, torch.float32, "nf4")
