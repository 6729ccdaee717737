"""``benchmarks/gpu_check.py``: its command line and the simulated-mesh memory check run on CPU here; the
whole check (NCCL, CUDA streams, peak CUDA memory, perparam vs FSDP2) runs where a GPU is."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gpu_check import main, parse_args, simulated_memory
from benchmarks.model import GPTConfig


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


@pytest.mark.parametrize("rank", [0, 7])
def test_simulated_eight_rank_model_state_matches_the_layout(rank):
    sim = simulated_memory(GPTConfig.quick(), 8, rank, "cpu", steps=2)
    measured, predicted = sim["model_state_bytes_measured"], sim["model_state_bytes_predicted"]
    assert measured["params"] == predicted["params"]
    assert measured["grads"] == predicted["grads"] + sim["used_flag_bytes"]
    assert measured["optimizer"] == predicted["optimizer"] + sim["adamw_step_counter_bytes"]
    assert len(sim["unsharded_group_bytes"]) == 4  # embeddings, 2 blocks, [norm, head]; the root has none


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_check_runs_on_cuda(tmp_path):
    result = main(["--quick", "--steps", "3", "--warmup", "1", "--json", str(tmp_path / "gpu.json")])
    assert result["nccl_world_1"]["ratio_perparam_vs_fsdp2"] > 0
    assert result["simulated"]["peak_allocated_bytes"] > 0
