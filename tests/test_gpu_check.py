"""``benchmarks/gpu/check.py``: its command line, the section runner (each section on its own, the JSON
rewritten after each), and every section run on CPU (``--device cpu``: a gloo world of one, the same code
as on CUDA but for the CUDA-only figures), so the check cannot break unseen before a GPU runs it."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.gpu.check import BUDGET_S, SECTIONS, TOTAL_BUDGET_S, main, parse_args
from benchmarks.gpu.simulated import simulated_memory
from benchmarks.harness.model import GPTConfig

CPU_QUICK = ["--device", "cpu", "--quick", "--steps", "1", "--warmup", "1", "--sim-steps", "1", "--batch",
             "2"]


def test_gpu_check_flags_are_checked_before_anything_starts(capsys):
    for argv, flag in ((["--sim-world", "0", "--device", "cpu"], "--sim-world"),
                       (["--sim-rank", "8", "--device", "cpu"], "--sim-rank"),
                       (["--steps", "0", "--device", "cpu"], "--steps")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert flag in capsys.readouterr().err.splitlines()[-1]
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            parse_args([])
        assert "--device cuda" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="unknown.*nope"):
        main(CPU_QUICK + ["--sections", "environment,nope"])


@pytest.mark.parametrize("rank", [0, 7])
def test_simulated_eight_rank_model_state_matches_the_layout(rank):
    sim = simulated_memory(GPTConfig.quick(), 8, rank, "cpu", steps=2)
    measured, predicted = sim["model_state_bytes_measured"], sim["model_state_bytes_predicted"]
    assert measured["params"] == predicted["params"]
    assert measured["grads"] == predicted["grads"] + sim["used_flag_bytes"]
    assert measured["optimizer"] == predicted["optimizer"] + sim["adamw_step_counter_bytes"]
    assert len(sim["unsharded_group_bytes"]) == 4  # embeddings, 2 blocks, [norm, head]; the root has none


def test_the_section_budgets_add_up_to_under_five_minutes():
    assert {n for n, _ in SECTIONS} < set(BUDGET_S) and sum(BUDGET_S.values()) <= TOTAL_BUDGET_S == 300


def test_a_failing_section_leaves_its_error_and_the_next_sections_run_with_the_json_written_after_each(
        tmp_path):
    path = tmp_path / "gpu.json"
    seen = []

    def fails(out, args):
        out["before_the_failure"] = 1
        raise RuntimeError("planted")

    def reads_the_file(out):  # one parameter: the accelerate section's form
        seen.append(json.loads(path.read_text()))
        out["x"] = 2

    result = main(CPU_QUICK + ["--sections", "environment,fails,reads", "--json", str(path)],
                  extra=[("fails", fails), ("reads", reads_the_file)])
    assert result["fails"]["ok"] is False and result["fails"]["error"] == "RuntimeError: planted"
    assert result["fails"]["before_the_failure"] == 1 and "planted" in result["fails"]["traceback"]
    assert result["reads"] == {"x": 2, "ok": True, "seconds": result["reads"]["seconds"]}
    # what the failed section wrote was on disk before the next one started
    assert seen[0]["fails"]["error"] == "RuntimeError: planted" and seen[0]["environment"]["ok"]
    assert json.loads(path.read_text())["reads"]["ok"]


def test_every_section_but_two_ranks_runs_on_cpu_and_says_what_it_measured(tmp_path):
    names = ",".join(n for n, _ in SECTIONS if n != "two_ranks")
    result = main(CPU_QUICK + ["--sections", names, "--json", str(tmp_path / "gpu.json")])
    failed = {n: r["traceback"] for n, r in result.items() if isinstance(r, dict) and r.get("ok") is False}
    assert not failed, failed
    env = result["environment"]
    assert env["missing_apis"] == [] and env["c10d_names"]["all_gather"] == "all_gather_single"
    assert result["simulated"]["params_match_plan"] and result["simulated"]["grads_match_plan"]
    assert result["parity"]["within_1e-5"], result["parity"]
    assert {"perparam_bf16", "fsdp2_bf16", "ddp_autocast_bf16"} <= set(result["step_time"])
    syncs = result["host_syncs"]["perparam_bf16"]
    # nothing read back or uploaded in forward and backward
    assert syncs["forward_backward"]["counted"] == 0, syncs
    [(site, n)] = syncs["clip_grad_norm"]["sites"].items()  # the agreement that no rank refused a gradient
    assert site.startswith("perparam/clip.py:") and n == 1, syncs
    tier = result["cpu_tier"]
    assert tier["params_bitwise_equal"] and tier["state_entries_equal_between_steps"], tier
    assert (tier["state_entries_without_storage_between_steps"]
            == tier["state_tensors_without_storage_between_steps"] == 0)
    assert all(result[n]["budget_s"] > 0 and "over_budget" in result[n] for n in names.split(","))
    assert result["budget_s"] == sum(BUDGET_S[n] for n in names.split(",")) and "over_total_budget" in result


def test_the_two_rank_section_trains_like_one_process_with_the_same_process_group_order_on_both_ranks():
    out = {}
    from benchmarks.gpu import two_ranks

    two_ranks.two_ranks(out, parse_args(CPU_QUICK))
    assert out["within_1e-5"], out
    assert out["same_first_use_order"], out["ranks"]
    assert out["ranks"][0]["counts"] == out["ranks"][1]["counts"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_check_runs_on_cuda(tmp_path):
    result = main(["--quick", "--steps", "3", "--warmup", "1", "--json", str(tmp_path / "gpu.json")])
    assert result["step_time"]["ratio_perparam_vs_fsdp2"] > 0
    assert result["simulated"]["peak_allocated_bytes"] > 0
