"""``perparam finetune --optimizer muon``: Muon on the decoder layers' projection matrices (each stepped whole
by an owner rank), AdamW on the rest. The tiny run trains, 2 ranks end where 1 rank does, a save at step 2
then ``--resume`` continues bitwise where the uninterrupted run is (also on 1 rank, owners re-planned), and
the flags Muon cannot compose with stop with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.finetune_helpers import TINY, assert_one_line_error, run_finetune

pytestmark = pytest.mark.slow
safetensors_torch = pytest.importorskip("safetensors.torch")

MUON = ("--optimizer", "muon")
# 2 ranks against 1: torch's Muon orthogonalizes in bf16, so the fp32 rounding of the gradient sums (the
# reduce-scatter's order) flips bf16 roundings, and Newton-Schulz amplifies them in the weak directions of
# each matrix: in one process, a relative gradient perturbation of 1e-7 moves the tiny model's weights by
# 2.6e-4 after these 4 steps (lr 3e-3). Measured 2 ranks against 1: losses within 1.1e-5, weights 6.7e-4.
# The owner's step itself is bitwise torch's (tests/test_whole_matrix.py); the resume below is bitwise.
LOSS_TOL, WEIGHT_TOL = 5e-5, 2e-3


def _run(tmp: Path, text: Path, name: str, *flags: str, nproc: int = 2) -> dict:
    out = tmp / f"{name}.json"
    proc = run_finetune(*TINY, *MUON, "--text", str(text), "--nproc", str(nproc), *flags, "--summary-json",
                        str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def muon_run(tmp_path_factory, text_dir):
    """``(folder, summary)`` of the uninterrupted tiny Muon run on 2 ranks, exported as safetensors."""
    tmp = tmp_path_factory.mktemp("muon")
    return tmp, _run(tmp, text_dir, "straight", "--export", str(tmp / "straight.safetensors"))


def test_muon_trains_and_two_ranks_end_where_one_rank_does(muon_run, text_dir, plain_tiny_run):
    tmp, two = muon_run
    _, adamw = plain_tiny_run
    assert two["optimizer"] == "muon" and adamw["optimizer"] == "adamw"
    losses = two["train_losses"]
    assert losses[-1] < losses[0] and two["heldout_loss_after"] < two["heldout_loss_before"]  # it trained
    assert losses[1:] != adamw["train_losses"][1:]  # Muon stepped the matrices, not AdamW
    assert two["comm_bytes_per_step"]["all_to_all"] > 0 and "all_to_all" not in adamw["comm_bytes_per_step"]
    one = _run(tmp, text_dir, "one", "--export", str(tmp / "one.safetensors"), nproc=1)
    assert max(abs(a - b) for a, b in zip(one["train_losses"], losses, strict=True)) <= LOSS_TOL
    a = safetensors_torch.load_file(str(tmp / "straight.safetensors"))
    b = safetensors_torch.load_file(str(tmp / "one.safetensors"))
    assert sorted(a) == sorted(b)
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= WEIGHT_TOL
    assert abs(one["heldout_loss_after"] - two["heldout_loss_after"]) <= LOSS_TOL


def test_muon_save_at_step_2_then_resume_equals_the_uninterrupted_run(muon_run, text_dir, capsys,
                                                                      monkeypatch):
    tmp, straight = muon_run
    ckpt = tmp / "ckpt"
    first = _run(tmp, text_dir, "first", "--steps", "2", "--save", str(ckpt), "--save-every", "1")
    assert first["train_losses"] == straight["train_losses"][:2]
    manifest = json.loads((ckpt / "step-000002" / "perparam_checkpoint.json").read_text())
    assert [o["class"] for o in manifest["optimizers"]] == ["Muon", "AdamW"]  # both optimizers' state
    assert any(k.endswith("momentum_buffer") for s in manifest["optimizers"][0]["state"].values() for k in s)
    resumed = _run(tmp, text_dir, "resumed", "--resume", str(ckpt))
    assert resumed["first_step"] == 2
    assert resumed["train_losses"] == straight["train_losses"][2:]  # fp32, same world: bitwise
    assert resumed["heldout_loss_after"] == straight["heldout_loss_after"]
    # owners re-planned for K = 1
    one_rank = _run(tmp, text_dir, "one-resumed", "--resume", str(ckpt), nproc=1)
    assert max(abs(a - b) for a, b in zip(one_rank["train_losses"], straight["train_losses"][2:])) <= LOSS_TOL
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert_one_line_error(capsys, [*TINY, "--text", str(text_dir), "--resume", str(ckpt)],
                          "the checkpoint was trained with --optimizer muon, this run has --optimizer adamw")


def test_muon_with_flags_it_cannot_compose_with_stops_with_one_line(capsys, text_dir, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    tiny = [*TINY, "--text", str(text_dir), *MUON]
    assert_one_line_error(capsys, [*tiny, "--lora", "8"], "--optimizer muon with --lora/--qlora")
    assert_one_line_error(capsys, [*tiny, "--offload", "layers.*=disk"], "--optimizer muon with --offload")
    assert_one_line_error(capsys, [*tiny, "--memory-budget", "1GiB"], "--optimizer muon with --memory-budget")
    assert_one_line_error(capsys, [*tiny, "--nproc", "4", "--batch-size", "4", "--tp", "2"],
                          "--optimizer muon with --tp 2")
