"""``benchmarks/harness/zero_formulas.py``: the formulas the ZeRO-stage benchmark sets its figures against are
Table 7-2's rows and the ZeRO paper's traffic, adjusted only where the configuration runs differently
(pure)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from benchmarks.harness.configs import seeded_full_init
from benchmarks.harness.model import GPTConfig
from benchmarks.harness.zero_formulas import formulas
from benchmarks.zero_stages import parse_args
from perparam.memory.formulas import BytesPerParam, stage_memory

MODEL = seeded_full_init(GPTConfig.quick(), 0)
N = sum(p.numel() for p in MODEL.parameters())
FP32_ADAMW = BytesPerParam(params=4, grads=4, optimizer=8)


@pytest.mark.parametrize("k", [2, 4])
def test_all_stage_configs_state_is_table_7_2_and_ddp_traffic_is_2_r_g(k):
    for name, stage in (("ddp", "DDP"), ("perparam_stage1", "ZeRO-1"), ("perparam_stage2", "ZeRO-2"),
                        ("perparam", "ZeRO-3"), ("fsdp2", "ZeRO-3")):
        assert (formulas(name, MODEL, k)["state"]
                == pytest.approx(float(stage_memory(stage, N, k, FP32_ADAMW).total)))
    ddp = float(2 * Fraction(k - 1, k) * 4 * N)
    f1, f2 = formulas("perparam_stage1", MODEL, k), formulas("perparam_stage2", MODEL, k)
    assert (formulas("ddp", MODEL, k)["sent_as_run"] == pytest.approx(ddp) == f2["sent_as_run"]
            == f1["sent_paper"])
    assert f1["sent_as_run"] == pytest.approx(1.5 * ddp)  # all-reduced gradient plus the refresh all-gather


def test_stage_3_gathers_the_kept_head_group_once_and_fsdp2_keep_everything_once():
    k, r = 2, 0.5
    kept = MODEL.ln_f.weight.numel() + MODEL.ln_f.bias.numel() + MODEL.head.weight.numel()
    s3 = formulas("perparam", MODEL, k)
    assert s3["sent_paper"] == pytest.approx(r * 12 * N)  # (K-1)/K (G + 2P)
    assert s3["sent_as_run"] == pytest.approx(r * 12 * N - r * 4 * kept)
    assert formulas("fsdp2", MODEL, k) == s3
    assert formulas("fsdp2_keep", MODEL, k)["sent_as_run"] == pytest.approx(r * 8 * N)


def test_mix_lies_between_stage_3_and_stage_1():
    mix, s1, s3 = (formulas(n, MODEL, 4) for n in ("perparam_mix", "perparam_stage1", "perparam"))
    assert s3["state"] < mix["state"] < s1["state"]


def test_zero_stages_flags_are_checked(capsys):
    assert parse_args(["--worlds", "2,4"]).worlds == [2, 4]
    assert parse_args(["--configs", "ddp,perparam_stage2"]).configs == ["ddp", "perparam_stage2"]
    for bad in (["--worlds", "1"], ["--worlds", "two"], ["--steps", "0"], ["--configs", "zero9"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    assert "--worlds" in capsys.readouterr().err
