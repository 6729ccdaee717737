"""``perparam finetune`` end to end on the tiny config (no assets), and its one-line errors for bad input."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.finetune_helpers import (
    REPO,
    TINY,
    assert_one_line_error,
    run_finetune,
    subprocess_env,
    write_tiny_gguf,
)


def _tiny_run(folder: Path, text_dir: Path, *flags: str,
              nproc: int = 2) -> tuple[subprocess.CompletedProcess, dict]:
    out = folder / "runs" / "summary.json"
    proc = run_finetune(*TINY, "--text", str(text_dir), "--nproc", str(nproc), *flags, "--summary-json",
                        str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(out.read_text())
    losses = [summary["heldout_loss_before"], summary["heldout_loss_after"], *summary["train_losses"]]
    assert len(summary["train_losses"]) == 4 and all(math.isfinite(x) for x in losses), losses
    return proc, summary


@pytest.fixture(scope="module")
def fp32_run(plain_tiny_run) -> tuple[subprocess.CompletedProcess, dict]:
    """The plain run (2 ranks, fp32, no quantization, 1D mesh): the baseline the other runs compare to
    (``plain_tiny_run`` of conftest.py, launched once per session and shared with other finetune tests)."""
    proc, summary = plain_tiny_run
    losses = [summary["heldout_loss_before"], summary["heldout_loss_after"], *summary["train_losses"]]
    assert len(summary["train_losses"]) == 4 and all(math.isfinite(x) for x in losses), losses
    return proc, summary


def _close(a: list[float], b: list[float], tol: float = 1e-5) -> bool:
    return max(abs(x - y) for x, y in zip(a, b, strict=True)) <= tol


def test_tiny_two_process_run_writes_summary(fp32_run):
    proc, summary = fp32_run
    for key in ("world_size", "steps", "params_total", "heldout_loss_before", "heldout_loss_after",
                "train_losses", "model_state_bytes_per_rank", "wall_s", "param_dtype", "quant",
                "comm_bytes_per_step", "all_gather_bytes_per_unshard"):
        assert key in summary, key
    assert summary["world_size"] == 2 and summary["steps"] == 4 and len(summary["train_losses"]) == 4
    assert (summary["dp_replicate"], summary["dp_shard"], summary["tp"]) == (1, 2, 1)
    assert (summary["param_dtype"], summary["quant"]) == ("fp32", "none")
    assert summary["heldout_loss_after"] < summary["heldout_loss_before"]
    n = summary["params_total"]
    per_rank = summary["model_state_bytes_per_rank"]
    assert abs(per_rank["params"] - 4 * n / 2) <= 4 * 64 * 20  # half the fp32 params, up to chunk rounding
    # no reduce-scatter padding (every dim is even); the used flags: 4 bytes per parameter tensor
    assert per_rank["grads"] == per_rank["params"] + 4 * summary["param_tensors"]
    assert abs(per_rank["optimizer"] - 8 * n / 2) <= 8 * 64 * 20 + 4 * 20
    assert summary["model_state_bytes_zero3_formula"] == {"params": 2 * n, "grads": 2 * n, "optimizer": 4 * n}
    # a step gathers each layer twice (forward, backward) and the root once; reduce-scatters every fp32 grad
    comm, unshard = summary["comm_bytes_per_step"], summary["all_gather_bytes_per_unshard"]
    assert comm["all_gather"] == 2 * unshard["layers"] + unshard["root"]
    # every fp32 gradient, plus one fp32 used flag per parameter tensor in each of the 2 ranks' pieces
    assert comm["reduce_scatter"] == 4 * n + 2 * 4 * summary["param_tensors"] and comm["all_reduce"] == 0
    assert "Model state per rank" in proc.stdout and "held-out loss after" in proc.stdout


@pytest.mark.slow
def test_hsdp_run_matches_the_plain_run(tmp_path, text_dir, fp32_run):
    """--nproc 4 --dp-replicate 2: 2 replicas of a model sharded over 2 ranks; the same global batches, so
    the same losses as the plain 2-rank run (which also means the replicas stayed equal)."""
    _, base = fp32_run
    _, summary = _tiny_run(tmp_path, text_dir, "--dp-replicate", "2", nproc=4)
    assert (summary["world_size"], summary["dp_replicate"], summary["dp_shard"],
            summary["tp"]) == (4, 2, 2, 1)
    assert _close(summary["train_losses"], base["train_losses"])
    assert _close([summary["heldout_loss_after"]], [base["heldout_loss_after"]])
    # each rank holds what a rank of the 2-rank run holds; gradients are also all-reduced over the replicas
    assert summary["model_state_bytes_per_rank"] == base["model_state_bytes_per_rank"]
    comm = summary["comm_bytes_per_step"]
    assert comm["all_gather"] == base["comm_bytes_per_step"]["all_gather"]
    assert comm["all_reduce"] == comm["reduce_scatter"] // 2 > 0


@pytest.mark.slow
def test_tp_run_matches_the_plain_run(tmp_path, text_dir, fp32_run):
    """--nproc 4 --tp 2: 2 data-parallel ranks, each a tensor-parallel pair; the same losses as the plain
    run, and each rank holds 1/(2x2) of the tensor-parallel weights and 1/2 of the rest."""
    _, base = fp32_run
    proc, summary = _tiny_run(tmp_path, text_dir, "--tp", "2", nproc=4)
    assert (summary["world_size"], summary["dp_replicate"], summary["dp_shard"],
            summary["tp"]) == (4, 1, 2, 2)
    assert _close(summary["train_losses"], base["train_losses"])
    assert _close([summary["heldout_loss_after"]], [base["heldout_loss_after"]])
    per_rank, zero3 = summary["model_state_bytes_per_rank"], summary["model_state_bytes_zero3_formula"]
    # no padding here; the gradients' storage also holds the reduce-scatter's used flags (4 bytes each)
    assert per_rank["params"] == zero3["params"]
    assert per_rank["grads"] == zero3["grads"] + 4 * summary["param_tensors"]
    assert zero3["params"] < 0.6 * base["model_state_bytes_zero3_formula"]["params"]
    assert "2 shard x 2 tp ranks" in summary["zero3_formula_k"] and "2 tensor-parallel ranks" in proc.stdout


@pytest.mark.slow
def test_bf16_compute_smoke(tmp_path, text_dir, fp32_run):
    _, base = fp32_run
    _, summary = _tiny_run(tmp_path, text_dir, "--param-dtype", "bf16")
    assert (summary["param_dtype"], summary["quant"]) == ("bf16", "none")
    assert summary["heldout_loss_after"] < summary["heldout_loss_before"]
    assert _close(summary["train_losses"], base["train_losses"], tol=0.02)  # bf16 rounding only
    # bf16 on the wire; gradients reduced in fp32; shards, grads and AdamW state stay fp32
    unshard, base_unshard = summary["all_gather_bytes_per_unshard"], base["all_gather_bytes_per_unshard"]
    assert 2 * unshard["layers"] == base_unshard["layers"] and 2 * unshard["root"] == base_unshard["root"]
    assert summary["comm_bytes_per_step"]["reduce_scatter"] == base["comm_bytes_per_step"]["reduce_scatter"]
    assert summary["model_state_bytes_per_rank"] == base["model_state_bytes_per_rank"]


# measured on this config: the layers' gathers (int8 codes + an fp32 scale per 256, or 4-bit NF4 codes + an
# fp32 scale per 64; fp32 norms) are 0.2565x / 0.1436x of fp32; a whole step, with the fp32 embedding gathered
# once, 0.331x / 0.229x
@pytest.mark.slow
@pytest.mark.parametrize("quant,layers,step", [("int8", 0.27, 0.34), ("nf4", 0.15, 0.24)])
def test_quantized_all_gather_smoke(tmp_path, text_dir, fp32_run, quant, layers, step):
    _, base = fp32_run
    _, summary = _tiny_run(tmp_path, text_dir, "--quant", quant)
    assert (summary["param_dtype"], summary["quant"]) == ("fp32", quant)
    assert summary["heldout_loss_after"] < summary["heldout_loss_before"]
    assert _close(summary["train_losses"], base["train_losses"], tol=0.01)
    unshard, base_unshard = summary["all_gather_bytes_per_unshard"], base["all_gather_bytes_per_unshard"]
    assert unshard["layers"] <= layers * base_unshard["layers"] and unshard["root"] == base_unshard["root"]
    assert summary["comm_bytes_per_step"]["all_gather"] <= step * base["comm_bytes_per_step"]["all_gather"]
    assert summary["comm_bytes_per_step"]["reduce_scatter"] == base["comm_bytes_per_step"]["reduce_scatter"]
    assert summary["model_state_bytes_per_rank"] == base["model_state_bytes_per_rank"]


@pytest.mark.slow
def test_torchrun_runs_the_module_unchanged(text_dir):
    """``torchrun --standalone --nproc_per_node 2 -m perparam.finetune ...``: each process is a worker."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", "-m", "perparam.finetune", "--config", "tiny",
                           "--text", str(text_dir), "--steps", "2", "--seq-len", "32", "--batch-size", "2",
                           "--eval-tokens", "64"],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**subprocess_env(), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "sharded over 2 ranks" in proc.stdout and "held-out loss after" in proc.stdout


@pytest.mark.slow
def test_a_dying_worker_fails_the_run_promptly(text_dir):
    """The process-group timeout is an hour: a run that ends at all (here within the 300 s guard) ended
    because its peer died, not at the timeout; no timing is asserted."""
    proc = run_finetune("--config", "tiny", "--text", str(text_dir), "--nproc", "2", "--steps", "50",
                        "--seq-len", "32", "--batch-size", "2", "--eval-tokens", "64", "--crash-at-step", "1",
                        "--pg-timeout", "3600", timeout=300)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("perparam finetune: error: rank 1 exited with code 17"), proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr  # the surviving rank reports the lost peer in one line


@pytest.fixture(scope="module")
def bad_ggufs(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("bad")
    good, other = folder / "good.gguf", folder / "falcon.gguf"
    write_tiny_gguf(good, quantize_ffn=False)
    write_tiny_gguf(other, arch="falcon", quantize_ffn=False)
    truncated = folder / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[:-100])
    return {"good": good, "other": other, "truncated": truncated}


def test_bad_inputs_give_one_line_errors(capsys, tmp_path, text_dir, bad_ggufs, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    tiny = ["--config", "tiny", "--text", str(text_dir)]
    assert_one_line_error(capsys, ["--gguf", str(tmp_path / "missing.gguf"), "--text", str(text_dir)],
                          "does not exist")
    assert_one_line_error(capsys, ["--gguf", str(bad_ggufs["truncated"]), "--text", str(text_dir)],
                          "truncated")
    assert_one_line_error(capsys, ["--gguf", str(bad_ggufs["other"]), "--text", str(text_dir)],
                          "architecture 'falcon'")
    assert_one_line_error(capsys, ["--assets", str(tmp_path / "no-assets")], "make assets")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_one_line_error(capsys, ["--config", "tiny", "--text", str(empty)], "no non-empty text file")
    assert_one_line_error(capsys, ["--config", "tiny", "--text", str(tmp_path / "nothing.txt")],
                          "does not exist")
    assert_one_line_error(capsys, [*tiny, "--nproc", "16", "--batch-size", "16", "--seq-len", "512"],
                          "larger than the data allows")
    assert_one_line_error(capsys, [*tiny, "--seq-len", "5000"], "above the model's context of 1024")
    assert_one_line_error(capsys,
                          ["--gguf", str(bad_ggufs["good"]), "--text", str(text_dir), "--seq-len", "300"],
                          "above the model's context of 256")
    assert_one_line_error(capsys, [*tiny, "--nproc", "3", "--batch-size", "4"], "cannot be split evenly")
    assert_one_line_error(capsys, [*tiny, "--nproc", "6", "--dp-replicate", "4"],
                          "pass a --nproc that is a multiple of 4")
    assert_one_line_error(capsys, [*tiny, "--nproc", "2", "--tp", "4"], "multiple of 4")
    assert_one_line_error(capsys, [*tiny, "--tp", "0"], "--tp 0 must be at least 1")
    missing = tmp_path / "no-such-folder"
    assert_one_line_error(capsys, [*tiny, "--offload", "*=disk", "--offload-dir", str(missing)],
                          f"--offload-dir '{missing}' does not exist; create it first")
    assert not missing.exists()  # refused, never created
    assert_one_line_error(capsys, [*tiny, "--offload", "*=disk", "--offload-dir", str(bad_ggufs["good"])],
                          "is not a folder")
    assert_one_line_error(capsys, [*tiny, "--nproc", "4", "--tp", "4"],
                          "--tp 4 does not divide the model's 2 key/value")
    assert_one_line_error(capsys, [*tiny, "--nproc", "4", "--tp", "2", "--batch-size", "3"],
                          "cannot be split evenly over 2 data-parallel ranks")
