"""``perparam finetune`` end to end on the tiny config (no assets), and its one-line errors for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from perparam.cli import main
from tests.test_finetune_gguf import write_tiny_gguf

REPO = Path(__file__).resolve().parents[1]
SONNET = """Shall I compare thee to a summer's day?
Thou art more lovely and more temperate:
Rough winds do shake the darling buds of May,
And summer's lease hath all too short a date;
"""


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("text")
    (folder / "a_sonnets.txt").write_text(SONNET * 60)
    (folder / "b_heldout.txt").write_text(SONNET[::-1] * 20)
    return folder


def _env() -> dict:
    env = dict(os.environ)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "perparam.cli", "finetune", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env=_env())


@pytest.mark.slow
def test_tiny_two_process_run_writes_summary(tmp_path, text_dir):
    out = tmp_path / "runs" / "summary.json"
    proc = _cli("--config", "tiny", "--text", str(text_dir), "--nproc", "2", "--steps", "4",
                "--seq-len", "32", "--batch-size", "4", "--lr", "3e-3", "--eval-tokens", "128",
                "--summary-json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(out.read_text())
    for key in ("world_size", "steps", "params_total", "heldout_loss_before", "heldout_loss_after",
                "train_losses", "model_state_bytes_per_rank", "wall_s"):
        assert key in summary, key
    assert summary["world_size"] == 2 and summary["steps"] == 4 and len(summary["train_losses"]) == 4
    assert summary["heldout_loss_after"] < summary["heldout_loss_before"]
    n = summary["params_total"]
    per_rank = summary["model_state_bytes_per_rank"]
    assert abs(per_rank["params"] - 4 * n / 2) <= 4 * 64 * 20  # half the fp32 params, up to chunk rounding
    assert per_rank["grads"] == per_rank["params"]
    assert abs(per_rank["optimizer"] - 8 * n / 2) <= 8 * 64 * 20 + 4 * 20
    assert "Model state per rank" in proc.stdout and "held-out loss after" in proc.stdout


@pytest.mark.slow
def test_torchrun_runs_the_module_unchanged(text_dir):
    """``torchrun --standalone --nproc_per_node 2 -m perparam.finetune ...``: each process is a worker."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", "-m", "perparam.finetune", "--config", "tiny",
                           "--text", str(text_dir), "--steps", "2", "--seq-len", "32", "--batch-size", "2",
                           "--eval-tokens", "64"],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**_env(), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "sharded over 2 ranks" in proc.stdout and "held-out loss after" in proc.stdout


@pytest.mark.slow
def test_a_dying_worker_fails_the_run_promptly(text_dir):
    start = time.monotonic()
    proc = _cli("--config", "tiny", "--text", str(text_dir), "--nproc", "2", "--steps", "50",
                "--seq-len", "32", "--batch-size", "2", "--eval-tokens", "64", "--crash-at-step", "1",
                timeout=90)
    assert proc.returncode != 0
    assert time.monotonic() - start < 60
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("perparam finetune: error: rank 1 exited with code 17"), proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr  # the surviving rank reports the lost peer in one line


def _one_line_error(capsys, argv: list[str], expect: str) -> None:
    code = main(["finetune", *argv])
    err = capsys.readouterr().err
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("perparam finetune: error: "), err
    assert expect in lines[0], lines[0]


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
    _one_line_error(capsys, ["--gguf", str(tmp_path / "missing.gguf"), "--text", str(text_dir)],
                    "does not exist")
    _one_line_error(capsys, ["--gguf", str(bad_ggufs["truncated"]), "--text", str(text_dir)], "truncated")
    _one_line_error(capsys, ["--gguf", str(bad_ggufs["other"]), "--text", str(text_dir)],
                    "architecture 'falcon'")
    _one_line_error(capsys, ["--assets", str(tmp_path / "no-assets")], "make assets")
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_line_error(capsys, ["--config", "tiny", "--text", str(empty)], "no non-empty text file")
    _one_line_error(capsys, ["--config", "tiny", "--text", str(tmp_path / "nothing.txt")], "does not exist")
    _one_line_error(capsys, [*tiny, "--nproc", "16", "--batch-size", "16", "--seq-len", "512"],
                    "larger than the data allows")
    _one_line_error(capsys, [*tiny, "--seq-len", "5000"], "above the model's context of 1024")
    _one_line_error(capsys, ["--gguf", str(bad_ggufs["good"]), "--text", str(text_dir), "--seq-len", "300"],
                    "above the model's context of 256")
    _one_line_error(capsys, [*tiny, "--nproc", "3", "--batch-size", "4"], "cannot be split evenly")
