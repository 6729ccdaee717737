"""``perparam finetune --zero-stage N``: with stage 1 each of 2 ranks keeps the parameters and gradients
whole and the AdamW state sharded, and the model-state table shows that measured row beside the planned rows
of stages 1, 2 and 3; ``--qlora`` with stage 1/2 stops with one line."""

from __future__ import annotations

import json

from tests.finetune_helpers import TINY, assert_one_line_error, run_finetune


def test_finetune_zero_stage_1_holds_whole_parameters_and_gradients_as_planned_for_stage_1(
        tmp_path, text_dir):
    """The flag reaches every ``fully_shard`` call: each rank holds the whole model (kept copies, the fp32
    shards views of them) and whole gradients, AdamW state sharded (parity of the stages themselves:
    tests/test_zero_stages.py)."""
    out = tmp_path / "stage1.json"
    proc = run_finetune(*TINY, "--text", str(text_dir), "--nproc", "2", "--zero-stage", "1",
                        "--summary-json", str(out), timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(out.read_text())
    assert summary["zero_stage"] == 1
    held, unsharded = summary["model_state_bytes_per_rank"], summary["model_state_bytes_unsharded"]
    assert held["params"] >= unsharded["params"]  # the kept copy (padded), the shard a view of it
    assert held["grads"] >= unsharded["grads"]  # the whole gradient
    assert held["optimizer"] < unsharded["optimizer"]  # AdamW state sharded over the 2 ranks
    losses = summary["train_losses"]
    assert all(x == x for x in losses) and losses[-1] < losses[0]
    # the model-state table: the measured stage-1 row equals the stage-1 plan (AdamW's step counters aside)
    by_mode = summary["model_state_bytes_by_mode"]
    assert by_mode["zero_stage"] == 1 and by_mode["mode"] == "full"
    planned, measured = by_mode["planned_rank0_by_stage"], by_mode["measured"]
    assert sorted(planned) == ["1", "2", "3"] and planned["1"] == by_mode["planned_rank0"]["full"]
    assert (measured["params"], measured["grads"]) == (planned["1"]["params"], planned["1"]["grads"])
    assert 0 <= measured["optimizer"] - planned["1"]["optimizer"] <= 8 * summary["param_tensors"]
    assert planned["1"]["params"] == planned["2"]["params"] > planned["3"]["params"]  # the kept whole copy
    # stage 1: the whole gradient
    assert planned["1"]["grads"] > planned["2"]["grads"] == planned["3"]["grads"]
    for row in ("full fine-tuning, stage 1", "full fine-tuning, stage 2", "full fine-tuning, stage 3",
                "(measured)"):
        assert row in proc.stdout, proc.stdout


def test_finetune_refuses_zero_stage_1_or_2_with_qlora(capsys, text_dir):
    assert_one_line_error(capsys,
                          [*TINY, "--text", str(text_dir), "--qlora", "--lora", "4", "--zero-stage", "2"],
                          "--zero-stage 2 cannot go with --qlora")


def test_qlora_table_marks_stages_1_and_2_refused_beside_stage_3(capsys):
    """QLoRA's NF4-stored base cannot be kept whole: its planned stage-1/2 rows say "refused" (no process)."""
    from perparam.finetune import lora_memory
    from perparam.finetune.lora import LoraConfig
    from perparam.finetune.model import LlamaConfig

    cfg = LoraConfig(4, 8.0, qlora=True)
    by_stage = lora_memory.planned_by_stage(LlamaConfig.tiny(), 2, cfg, "qlora")
    assert by_stage["1"] is None and by_stage["2"] is None and by_stage["3"]["zero_stage"] == 3
    planned = lora_memory.planned_bytes(LlamaConfig.tiny(), 2, cfg, zero_stage=1)
    assert planned["qlora"]["zero_stage"] == 3 and planned["full"]["zero_stage"] == 1
    measured = {**by_stage["3"]}
    lora_memory.print_mode_table({"planned_rank0": planned, "planned_rank0_by_stage": by_stage,
                                  "measured": measured, "mode": "qlora", "zero_stage": 3, "lora_rank": 4,
                                  "lora_targets": ["q_proj"], "shard_ranks": 2})
    out = capsys.readouterr().out
    assert out.count("refused") == 2 * 4, out  # params, grads, optimizer, total of stages 1 and 2
