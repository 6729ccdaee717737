"""``perparam finetune --zero-stage N``: with stage 1 each of 2 ranks keeps the parameters and gradients
whole and the AdamW state sharded; ``--qlora`` with stage 1/2 stops with one line."""

from __future__ import annotations

import json

from tests.finetune_helpers import TINY, assert_one_line_error, run_finetune


def test_finetune_zero_stage_1_holds_whole_parameters_and_gradients(tmp_path, text_dir):
    """The flag reaches every ``fully_shard`` call: each rank holds the whole model (kept copies plus shards)
    and whole gradients, AdamW state sharded (parity of the stages themselves: tests/test_zero_stages.py)."""
    out = tmp_path / "stage1.json"
    proc = run_finetune(*TINY, "--text", str(text_dir), "--nproc", "2", "--zero-stage", "1",
                        "--summary-json", str(out), timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(out.read_text())
    assert summary["zero_stage"] == 1
    held, unsharded = summary["model_state_bytes_per_rank"], summary["model_state_bytes_unsharded"]
    assert held["params"] >= unsharded["params"]  # the kept copy (padded), plus the shard
    assert held["grads"] >= unsharded["grads"]  # the whole gradient
    assert held["optimizer"] < unsharded["optimizer"]  # AdamW state sharded over the 2 ranks
    losses = summary["train_losses"]
    assert all(x == x for x in losses) and losses[-1] < losses[0]


def test_finetune_refuses_zero_stage_1_or_2_with_qlora(capsys, text_dir):
    assert_one_line_error(capsys, [*TINY, "--text", str(text_dir), "--qlora", "--lora", "4", "--zero-stage", "2"],
                          "--zero-stage 2 cannot go with --qlora")
