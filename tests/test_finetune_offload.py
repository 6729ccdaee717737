"""``perparam finetune --memory-budget`` / ``--offload``: planned, applied, measured, and the training it
runs is the one without offload (the disk tier changes where bytes live, not what is computed)."""

from __future__ import annotations

import json

import pytest

from tests.finetune_helpers import TINY, assert_one_line_error, run_finetune


@pytest.mark.slow  # one launcher run of 2 workers, compared with the shared plain run (conftest.py)
def test_memory_budget_plans_applies_and_trains_exactly_as_without(tmp_path, text_dir, plain_tiny_run):
    budgeted = tmp_path / "budget.json"
    _, want = plain_tiny_run  # the same flags without offload: TINY on text_dir, 2 ranks
    per_rank = max(sum(r[k] for k in ("params", "grads", "optimizer"))
                   for r in want["model_state_bytes_by_rank"])
    budget = per_rank // 2  # AdamW state alone is half of fp32 training's model state: some shards go too
    done = run_finetune(*TINY, "--text", str(text_dir), "--nproc", "2", "--summary-json", str(budgeted),
                        "--memory-budget", str(budget), "--offload-dir", str(tmp_path), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(budgeted.read_text())
    assert got["train_losses"] == want["train_losses"]
    assert got["heldout_loss_after"] == want["heldout_loss_after"]
    for entry in got["offload"]["by_rank"]:
        assert entry["planned_bytes"] == entry["measured_bytes"] and entry["measured_bytes"]["disk"] > 0
        # the budget counts shards, gradients and AdamW's two moments; the measured bytes add the
        # reduce-scatter's used flags and AdamW's step counters (under 0.1% here)
        assert per_rank - entry["planned_bytes"]["disk"] <= budget * 1.001
    assert "--memory-budget" in done.stdout and "offload rank 1: disk planned" in done.stdout
    assert not list(tmp_path.glob("perparam-offload-*"))  # the workers removed their scratch folders


def test_bad_offload_flags_are_one_line_errors(capsys):
    assert_one_line_error(capsys, [*TINY, "--offload", "layers.*=tape"], "expected PATTERN=TIER")
    assert_one_line_error(capsys, [*TINY, "--memory-budget", "lots"], "not a byte count")
    assert_one_line_error(capsys, [*TINY, "--memory-budget", "1e9", "--offload", "*=disk"], "drop --offload")
