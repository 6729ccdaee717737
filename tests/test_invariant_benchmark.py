"""``python -m benchmarks.invariant_step --quick`` runs end to end (2 ranks, the toy GPT) and writes the JSON
its docstring describes: every variant trains the same global batches to the same loss, and the gradient
buffers the K-invariant mode holds are the counted ones (no timing is asserted)."""

from __future__ import annotations

import json

import pytest

KEYS = {"step_s", "step_times_s", "cpu_s_per_rank", "phase_s_rank0", "final_loss", "paired_vs_plain",
        "memory"}


def test_quick_invariant_benchmark_writes_json_and_counts_the_trees_gradient_buffers(tmp_path):
    from benchmarks.invariant_step import main

    out = tmp_path / "invariant.json"
    main(["--quick", "--units", "4,8", "--rounds", "1", "--warmup", "0", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["meta"]["world_size"] == 2 and result["meta"]["quick"] is True
    variants = result["variants"]
    assert list(variants) == ["plain", "accum_u4", "invariant_u4", "accum_u8", "invariant_u8"]
    for name, v in variants.items():
        assert KEYS <= v.keys(), (name, KEYS - v.keys())
        assert v["step_s"] > 0 and len(v["step_times_s"]) == 1 and v["memory"]["step_peak"] > 0
        # the same weights and global batches: one step of each gives the same global loss
        assert v["final_loss"] == pytest.approx(variants["plain"]["final_loss"], abs=1e-5), name
    full = variants["plain"]["memory"]["unsharded_grad_bytes"]
    shard = variants["plain"]["memory"]["shard_grad_bytes"]
    assert full >= 2 * shard - 64  # K = 2 (rows padded at most one per parameter)
    for u, trees in ((4, 1), (8, 2)):  # log2(U / K) unsharded buffers at the peak, the accumulation's 1
        accum, inv = variants[f"accum_u{u}"]["memory"], variants[f"invariant_u{u}"]["memory"]
        assert accum["grad_buffer_peak"] == full
        assert inv["grad_buffer_peak"] == trees * full
        assert inv["extra_grad_buffer_bytes"] == (trees - 1) * full <= inv["target_bytes"] + 64
