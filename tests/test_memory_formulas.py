"""The ZeRO formulas reproduce the textbook tables exactly; ``perparam memory`` prints them."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from perparam.cli import main
from perparam.memory import formulas
from perparam.memory.formulas import (
    GB,
    BytesPerParam,
    communication_table,
    format_fixed,
    format_gb,
    memory_table,
    model_state,
    parse_count,
    stage_communication,
    stage_memory,
)

pytestmark = pytest.mark.fast

N, K = 1_500_000_000, 64
TABLE_GB = ["24.000000", "6.281250", "3.328125", "0.375000"]
TABLE_RATIO = ["1.00", "3.82", "7.21", "64.00"]


def test_components_match_table_7_1():
    state = model_state(N)
    assert (state.params, state.grads, state.optimizer, state.total) == (3 * GB, 3 * GB, 18 * GB, 24 * GB)


def test_stages_match_table_7_2_exactly():
    rows = memory_table(N, K)
    assert [r.stage for r in rows] == ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    assert [r.total for r in rows] == [24 * GB, 6_281_250_000, 3_328_125_000, 375_000_000]
    assert [format_gb(r.total) for r in rows] == TABLE_GB
    assert [format_fixed(r.ratio_vs_ddp, 2) for r in rows] == TABLE_RATIO
    assert rows[3].ratio_vs_ddp == 64
    # component split: ZeRO-1 shards O, ZeRO-2 shards G and O, ZeRO-3 shards everything
    z1, z2, z3 = rows[1:]
    assert (z1.params, z1.grads, z1.optimizer) == (3 * GB, 3 * GB, Fraction(18 * GB, 64))
    assert (z2.params, z2.grads, z2.optimizer) == (3 * GB, Fraction(3 * GB, 64), Fraction(18 * GB, 64))
    assert (z3.params, z3.grads, z3.optimizer) == tuple(Fraction(x * GB, 64) for x in (3, 3, 18))


def test_bytes_per_param_are_arguments():
    # 8-bit Adam: 2 + 2 + 6 bytes per parameter -> 15 GB per DDP rank
    row = stage_memory("ZeRO-1", N, K, BytesPerParam(optimizer=6))
    assert row.total == 3 * GB + 3 * GB + Fraction(9 * GB, 64)
    assert row.ddp_total == 15 * GB
    assert BytesPerParam(0.5, "1.5", Fraction(3)).total == 5
    with pytest.raises(ValueError):
        BytesPerParam(params=-1)


def test_frozen_parameters_have_no_grads_or_optimizer_state():
    row = stage_memory("DDP", 100, 4, trainable_params=25)
    assert (row.params, row.grads, row.optimizer) == (200, 50, 300)
    with pytest.raises(ValueError):
        model_state(10, trainable_params=11)


def test_communication_ratios():
    g = 3 * GB  # fp16 gradients of 1.5e9 parameters
    rows = communication_table(N, K)  # as perparam runs each stage, then the paper's ZeRO-1
    assert [r.stage for r in rows] == ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "ZeRO-1 (paper)"]
    assert rows[0].all_reduce == 2 * Fraction(63, 64) * g
    assert [r.total for r in rows] == [x * Fraction(63, 64) * g for x in (2, 3, 2, 3, 2)]
    assert [r.volume_vs_ddp for r in rows] == [1, Fraction(3, 2), 1, Fraction(3, 2), 1]
    # perparam's stage 1 all-reduces the gradients (each rank keeps them whole), then refreshes the copy
    assert rows[1].all_reduce == rows[0].all_reduce and rows[1].all_gather == Fraction(63, 64) * g
    assert rows[4].reduce_scatter == rows[4].all_gather == Fraction(63, 64) * g
    assert "not run by perparam" in rows[4].collectives
    assert rows[3].all_gather == 2 * Fraction(63, 64) * g
    # one rank: nothing to send
    assert all(r.total == 0 and r.volume_vs_ddp == 1 for r in communication_table(N, 1))


def test_unknown_stage_and_bad_world():
    with pytest.raises(ValueError):
        stage_memory("ZeRO-4", N, K)
    with pytest.raises(ValueError):
        stage_communication("DDP", N, 0)


@pytest.mark.parametrize(
    "text, value",
    [("1.5e9", 1_500_000_000), ("1.5B", 1_500_000_000), ("124M", 124_000_000),
     ("1_557_611_200", 1_557_611_200), ("7b", 7_000_000_000), ("2.5K", 2500), (" 42 ", 42),
     (1.5e9, 1_500_000_000)],
)
def test_parse_count(text, value):
    assert parse_count(text) == value


@pytest.mark.parametrize("text", ["1.5", "-3", "abc", "1e-3"])
def test_parse_count_rejects(text):
    with pytest.raises(ValueError):
        parse_count(text)


def test_format_fixed_is_exact():
    assert format_fixed(Fraction(1, 3), 6) == "0.333333"
    assert format_fixed(Fraction(24) / Fraction("6.28125"), 2) == "3.82"
    assert format_fixed(Fraction(-1, 8), 2) == "-0.12"  # half to even
    assert format_fixed(7, 0) == "7"
    assert format_gb(6_281_250_000) == "6.281250"


@given(
    n=st.integers(0, 10**13),
    k=st.integers(1, 4096),
    p=st.fractions(0, 8, max_denominator=8),
    g=st.fractions(0, 8, max_denominator=8),
    o=st.fractions(0, 20, max_denominator=8),
)
def test_formula_properties(n, k, p, g, o):
    bpp = BytesPerParam(p, g, o)
    ddp, z1, z2, z3 = memory_table(n, k, bpp)
    assert ddp.total == n * (p + g + o)
    assert ddp.total >= z1.total >= z2.total >= z3.total
    assert z3.total * k == ddp.total
    assert z1.total == n * (p + g) + n * o / k
    comm = communication_table(n, k, bpp)
    assert comm[0].total == 2 * Fraction(k - 1, k) * n * g
    r = Fraction(k - 1, k)
    assert comm[3].total - comm[2].total == r * n * p  # the backward all-gather
    assert comm[1].total - comm[2].total == r * n * g  # stage 1 all-reduces what stage 2 reduce-scatters
    assert comm[4].total == comm[2].total  # the paper's ZeRO-1 sends what stage 2 sends
    if p == g and n and g and k > 1:
        assert [c.volume_vs_ddp for c in comm] == [1, Fraction(3, 2), 1, Fraction(3, 2), 1]


# -- CLI ----------------------------------------------------------------------------------------------

def test_cli_tables(capsys):
    assert main(["memory", "--params", "1.5e9", "--world", "64"]) == 0
    out = capsys.readouterr().out
    for text in [*TABLE_GB, *TABLE_RATIO, "3.000000", "18.000000", "ZeRO-1", "ZeRO-2", "ZeRO-3"]:
        assert text in out
    # rows that start with a stage name: four of the per-stage table, then five of the communication table
    # (perparam's stages, then the paper's ZeRO-1, labelled)
    stages = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
    rows = [line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0] in stages]
    # not the formula notes under the tables
    rows = [row for row in rows if row[1] not in ("=", "(perparam's")]
    assert len(rows) == 9
    assert [row[4] for row in rows[:4]] == TABLE_GB
    assert [row[5] for row in rows[:4]] == TABLE_RATIO
    assert [row[-1] for row in rows[4:]] == ["1.00", "1.50", "1.00", "1.50", "1.00"]
    assert rows[8][:2] == ["ZeRO-1", "(paper)"] and "not run by perparam" in out
    assert "5.906250" in out and "8.859375" in out


def test_cli_json(capsys):
    assert main(["memory", "--params", "1.5e9", "--world", "64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_params"] == N and data["world_size"] == K
    assert data["components"]["total"] == {"bytes": 24 * GB, "gb": 24.0}
    assert [s["total_bytes"] for s in data["stages"]] == [24 * GB, 6_281_250_000, 3_328_125_000, 375_000_000]
    assert [s["total_gb_str"] for s in data["stages"]] == TABLE_GB
    assert [round(s["ratio_vs_ddp"], 2) for s in data["stages"]] == [1.0, 3.82, 7.21, 64.0]
    assert [c["total_bytes"] for c in data["communication"]] == [5_906_250_000, 8_859_375_000, 5_906_250_000,
                                                                  8_859_375_000, 5_906_250_000]
    assert [c["volume_vs_ddp"] for c in data["communication"]] == [1.0, 1.5, 1.0, 1.5, 1.0]
    assert data["communication"][4]["stage"] == "ZeRO-1 (paper)"


def test_cli_byte_flags(capsys):
    args = ["memory", "--params", "1B", "--world", "8", "--param-bytes", "4", "--grad-bytes", "4",
            "--optim-bytes", "8", "--json"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["bytes_per_param"] == {"params": 4, "grads": 4, "optimizer": 8, "total": 16}
    assert data["stages"][3]["total_bytes"] == 2 * GB
    assert data["stages"][1]["total_bytes"] == 8 * GB + GB


def test_cli_rejects_bad_world(capsys):
    assert main(["memory", "--world", "0"]) == 2
    assert "--world" in capsys.readouterr().err


def test_package_exports():
    import perparam.memory as m

    assert m.STAGES == formulas.STAGES and m.memory_table is memory_table
