"""``python -m benchmarks.step_time --quick`` runs end to end and writes the JSON the README describes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ["bound", "ddp", "fsdp2", "fsdp2_bf16", "perparam", "perparam_bf16", "perparam_int8",
           "perparam_int8_grad", "perparam_int8_both"]
OK_KEYS = {"description", "status", "step_time_s", "phase_time_s", "cpu_time_s", "final_loss",
           "model_state_bytes", "model_state_bytes_per_rank", "comm_bytes_per_step", "comm_source",
           "comm_sent_bytes_per_rank", "comm_sent_vs_zero3_model", "peak_rss_bytes",
           "training_peak_rss_bytes", "training_peak_over_baseline_bytes", "rss_profile_rank0",
           "ratio_vs_bound", "ratio_vs_ddp", "ratio_vs_fsdp2", "ratio_vs_fsdp2_bf16",
           "paired_ratio_vs_fsdp2", "paired_ratio_vs_fsdp2_bf16", "memory_ratio_vs_fsdp2",
           "training_peak_ratio_vs_ddp", "training_peak_ratio_vs_fsdp2",
           "training_peak_over_baseline_bytes_returning", "training_peak_ratio_vs_ddp_returning",
           "training_peak_ratio_vs_fsdp2_returning"}


@pytest.mark.slow
def test_quick_benchmark_writes_json(tmp_path):
    out = tmp_path / "step_time.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.step_time", "--quick", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())

    meta = result["meta"]
    assert {"date", "machine", "loadavg", "model", "steps", "warmup", "world_size"} <= meta.keys()
    assert {"nproc", "cpu_model"} <= meta["machine"].keys()
    assert meta["world_size"] == 2 and meta["quick"] is True
    assert list(result["configs"]) == CONFIGS

    for name in ("bound", "ddp", "fsdp2", "fsdp2_bf16", "perparam"):  # the baselines must always run
        assert result["configs"][name]["status"] == "ok", (name, result["configs"][name].get("reason"))
    for name, c in result["configs"].items():
        assert c["status"] in ("ok", "unsupported"), (name, c.get("reason"))
        if c["status"] == "unsupported":
            assert c["reason"]
            continue
        assert OK_KEYS <= c.keys(), (name, OK_KEYS - c.keys())
        assert c["step_time_s"]["median"] > 0 and c["step_time_s"]["n"] == meta["steps"]
        assert c["model_state_bytes"]["total"] > 0 and c["peak_rss_bytes"] > 0
        assert (len(c["training_peak_rss_bytes"]) == meta["world_size"]
                and min(c["training_peak_rss_bytes"]) > 0)
        assert [p["phase"] for p in c["rss_profile_rank0"]][-4:] == ["forward", "backward", "optimizer",
                                                                     "end"]
        assert (c["comm_bytes_per_step"]["total"] > 0) == (name != "bound")
        assert c["ratio_vs_bound"] > 0 and c["ratio_vs_fsdp2"] > 0 and c["memory_ratio_vs_fsdp2"] > 0

    fsdp2, pp, ddp = (result["configs"][n] for n in ("fsdp2", "perparam", "ddp"))
    assert fsdp2["ratio_vs_fsdp2"] == 1.0 and fsdp2["memory_ratio_vs_fsdp2"] == 1.0
    assert result["configs"]["bound"]["ratio_vs_bound"] == 1.0
    # same model, data and initial weights: the fp32 configurations train alike
    assert abs(pp["final_loss"] - fsdp2["final_loss"]) < 1e-3 and abs(ddp["final_loss"]
                                                                      - fsdp2["final_loss"]) < 1e-3
    # FSDP2 and perparam move the same bytes in fp32 (one all-gather per group in forward, again in
    # backward for the blocks; one reduce-scatter per group), plus perparam's used flags: one fp32 per
    # trainable parameter in each rank's reduce-scatter piece; DDP all-reduces every gradient once
    from benchmarks.harness.model import GPT, GPTConfig

    flags = 2 * 4 * len(list(GPT(GPTConfig.quick()).parameters()))
    pp_comm, fsdp2_comm = dict(pp["comm_bytes_per_step"]), fsdp2["comm_bytes_per_step"]
    pp_comm["reduce_scatter"] -= flags
    pp_comm["total"] -= flags
    assert pp_comm == fsdp2_comm
    assert fsdp2["comm_bytes_per_step"]["reduce_scatter"] == ddp["comm_bytes_per_step"]["all_reduce"]
    # what perparam's counter says each rank sends equals what its torch.distributed calls send
    assert pp["comm_sent_bytes_per_rank_dist_wrappers"] == pp["comm_sent_bytes_per_rank"]
    # gloo: the all-gathers and the reduce-scatters are both zero-copy sends (perparam.comm.collectives:
    # all_gather_in_place, reduce_scatter_in_place): no all-to-all is left in an fp32 step
    assert set(pp["comm_bytes_per_step_dist_wrappers"]) == {"send"}
    # ZeRO-3 over 2 ranks holds half of DDP's model state (AdamW's per-parameter step counters are not
    # sharded: a few bytes more)
    assert pp["model_state_bytes"]["params"] * 2 == ddp["model_state_bytes"]["params"]
    assert abs(pp["model_state_bytes"]["total"] * 2 / ddp["model_state_bytes"]["total"] - 1) < 0.01
    # in bf16 too (bf16 all-gathers, fp32 reduce-scatters)
    pp16, fsdp16 = (dict(result["configs"]["perparam_bf16"]["comm_bytes_per_step"]),
                    result["configs"]["fsdp2_bf16"])
    pp16["reduce_scatter"] -= flags
    pp16["total"] -= flags
    assert pp16 == fsdp16["comm_bytes_per_step"]


def test_benchmark_flags_are_checked_before_anything_starts(capsys):
    from benchmarks.step_time import parse_args

    for argv, flag in ((["--world", "1"], "--world"), (["--configs", "ddp,nope"], "--configs"),
                       (["--steps", "0"], "--steps")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert flag in capsys.readouterr().err.splitlines()[-1]
    assert parse_args(["--world", "4", "--quick"]).world == 4
