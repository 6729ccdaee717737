"""``perparam memory --budget``: which ZeRO stage fits a per-rank byte budget, with the fewest bytes sent as
perparam runs each stage (pure: no processes)."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from perparam.cli import main
from perparam.memory.formulas import BytesPerParam
from perparam.memory.stage_budget import choose, min_world_for_zero3, sent_per_step, stage_fits

N, K = 1_500_000_000, 64


def test_budget_of_8gb_at_k64_chooses_stage_2_with_table_7_2_bytes():
    fits = stage_fits(N, K, 8 * 10**9)
    assert [f.stage for f in fits] == ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    assert [f.bytes_per_rank for f in fits] == [24 * 10**9, 6_281_250_000, 3_328_125_000, 375_000_000]
    assert [f.fits for f in fits] == [False, True, True, True]
    assert choose(fits).stage == "ZeRO-2"


def test_traffic_is_ddp_for_stage_2_and_one_and_a_half_ddp_for_stages_1_and_3():
    ddp = sent_per_step("DDP", N, K)
    assert ddp == 2 * Fraction(K - 1, K) * 2 * N  # fp16 gradients
    ratios = [sent_per_step(s, N, K) / ddp for s in ("ZeRO-1", "ZeRO-2", "ZeRO-3")]
    assert ratios == [Fraction(3, 2), 1, Fraction(3, 2)]


def test_stage_2_is_chosen_over_ddp_when_both_fit_and_ddp_at_one_rank():
    assert choose(stage_fits(N, K, 10**12)).stage == "ZeRO-2"  # same bytes sent, fewer held
    assert choose(stage_fits(N, 1, 10**12)).stage == "DDP"  # nothing sent, the same bytes held: lowest stage


def test_only_stage_3_fits_a_small_budget_and_none_fits_a_smaller_one():
    assert choose(stage_fits(N, K, 10**9)).stage == "ZeRO-3"
    assert choose(stage_fits(N, K, 10**8)) is None
    assert min_world_for_zero3(N, 10**8) == 240  # 24 GB / 0.1 GB
    assert min_world_for_zero3(N, 0) is None


def test_ddp_is_chosen_over_stage_2_when_weights_are_wider_than_gradients():
    bpp = BytesPerParam(params=4, grads=2, optimizer=12)  # DDP sends 2G = 4, stage 2 G + P = 6 (x (K-1)/K)
    assert choose(stage_fits(N, K, 10**12, bpp)).stage == "DDP"
    assert choose(stage_fits(N, K, 10 * 10**9, bpp)).stage == "ZeRO-2"  # DDP's 27 GB does not fit


@pytest.mark.parametrize("p,g,o", [(2, 2, 12), (4, 4, 8), (4, 2, 12), (2, 4, 12), (1, 4, 0)])
def test_stage_1_is_never_chosen_since_stage_2_fits_whenever_it_does_and_sends_no_more(p, g, o):
    bpp = BytesPerParam(p, g, o)
    for k in (1, 2, 3, 64):
        for budget in (10**8, 10**9, 4 * 10**9, 8 * 10**9, 10**10, 10**11):
            fits = stage_fits(N, k, budget, bpp)
            assert fits[1].fits <= fits[2].fits and fits[1].sent_per_step >= fits[2].sent_per_step
            chosen = choose(fits)
            assert chosen is None or chosen.stage != "ZeRO-1"


def test_bad_budget_and_stage_are_refused():
    with pytest.raises(ValueError, match="budget must be >= 0"):
        stage_fits(N, K, -1)
    with pytest.raises(ValueError, match="unknown stage"):
        sent_per_step("ZeRO-4", N, K)


def test_cli_budget_prints_each_stage_and_the_choice(capsys):
    assert main(["memory", "--params", "1.5e9", "-K", "64", "--budget", "8GB"]) == 0
    out = capsys.readouterr().out
    assert "Which stage fits a budget of 8.000000 GB" in out
    assert "Fits with the fewest bytes sent: ZeRO-2 (ParamPolicy(zero_stage=2): 3.328125 GB per rank" in out
    for line in ("DDP        24.000000     no", "ZeRO-1      6.281250    yes", "ZeRO-3      0.375000    yes"):
        assert line in out


def test_cli_budget_json_and_no_fit(capsys):
    assert main(["memory", "--params", "1.5e9", "-K", "2", "--budget", "8e9", "--json"]) == 0
    budget = json.loads(capsys.readouterr().out)["budget"]
    assert budget["chosen"] is None and budget["min_world_for_zero3"] == 3
    assert [s["fits"] for s in budget["stages"]] == [False, False, False, False]
    assert main(["memory", "--params", "1.5e9", "-K", "2", "--budget", "8GB"]) == 0
    assert "No stage fits: ZeRO-3 fits this budget from K = 3 ranks on" in capsys.readouterr().out


def test_cli_rejects_a_bad_budget(capsys):
    with pytest.raises(SystemExit):
        main(["memory", "--budget", "8XB"])
    assert "argument --budget: not a byte count: '8XB'" in capsys.readouterr().err
