"""``perparam finetune --invariant-units U``: the rule (a power of two that --nproc divides, a batch of whole
units) and the flags the mode refuses are one-line errors before any worker starts; the global batch is cut
into the same units whatever the number of ranks, each rank taking its contiguous U/K of them, at every
step of the stream; ``--nproc 1`` and ``4`` write the same per-step losses, gradient norms, held-out losses
and GGUF bit for bit, and a checkpoint saved at ``--nproc 4`` resumed at ``--nproc 2`` ends on the same
losses, GGUF and checkpoint (parameters, AdamW state, schedule) as the uninterrupted ``--nproc 4`` run."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from perparam.finetune import invariant_flags
from perparam.finetune.data import BatchStream
from tests.finetune_helpers import REPO, TINY, assert_one_line_error, subprocess_env

#: the runs compared: TINY, 4 units, clipped, evaluated at step 2, exported
RUN = ("--invariant-units", "4", "--max-grad-norm", "0.5", "--eval-every", "2")


@pytest.mark.parametrize("flags,expect", [
    (["--invariant-units", "3"], "--invariant-units 3 must be a power of two"),
    (["--invariant-units", "0"], "--invariant-units 0 must be a power of two"),
    (["--invariant-units", "2", "--nproc", "4"], "--invariant-units 2 is not divisible by --nproc 4"),
    (["--invariant-units", "8", "--nproc", "2"], "--batch-size 4 cannot be cut into --invariant-units 8"),
    (["--invariant-units", "4", "--nproc", "2", "--tp", "2"],
     "--invariant-units with --tp 2: tensor parallelism"),
    (["--invariant-units", "4", "--nproc", "2", "--grad-quant", "int8"],
     "--invariant-units with --grad-quant int8: quantized gradient reduction"),
    (["--invariant-units", "4", "--grad-accum", "3"], "--invariant-units with --grad-accum 3: a step's U x"),
    (["--invariant-units", "4", "--quant", "int8"],
     "--invariant-units with --quant int8: a quantized all-gather"),
])
def test_invariant_units_rule_and_refused_flags_are_one_line_errors(capsys, text_dir, flags, expect):
    assert_one_line_error(capsys, [*TINY, "--text", str(text_dir), *flags], expect)


def test_invariant_units_without_the_library_mode_are_refused_not_run_silently(capsys, text_dir, monkeypatch):
    monkeypatch.setattr(invariant_flags, "MODE_MODULE", "perparam.no_such_mode")
    assert_one_line_error(capsys, [*TINY, "--text", str(text_dir), "--invariant-units", "4", "--nproc", "2"],
                          "no K-invariant mode (perparam.no_such_mode")


def test_invariant_units_on_cuda_with_several_ranks_are_refused_before_workers_start(
        capsys, text_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert_one_line_error(capsys, [*TINY, "--text", str(text_dir), "--invariant-units", "4", "--nproc", "2"],
                          "--invariant-units on CUDA with --nproc 2")


def test_the_global_batch_is_cut_into_the_same_units_on_1_2_and_4_ranks():
    rows = torch.arange(40 * 9).reshape(40, 9)
    stream = BatchStream(rows, batch_size=8, seed=3)
    for step in (0, 4, 7):  # 5 steps per epoch: 7 is in the second permutation
        inputs, _ = stream.global_batch(step)
        units = invariant_flags.units(inputs, 4)
        assert [u.shape[0] for u in units] == [2] * 4 and torch.equal(torch.cat(units), inputs)
        for world in (1, 2, 4):
            taken = [i for r in range(world) for i in invariant_flags.rank_units(4, r, world)]
            assert taken == [0, 1, 2, 3]  # contiguous U/K units per rank, in rank order
            for rank in range(world):
                mine = torch.cat([units[i] for i in invariant_flags.rank_units(4, rank, world)])
                assert torch.equal(mine, stream.rank_batch(step, rank, world)[0])  # the rank's usual rows
    with pytest.raises(ValueError, match="cannot be cut into 3 equal units"):
        invariant_flags.units(rows[:8], 3)



def test_the_heldout_rows_are_a_multiple_of_the_units_the_same_at_every_nproc():
    from perparam.finetune.data import prepare_data
    from perparam.finetune.errors import FinetuneInputError
    from perparam.finetune.tokenizer import ByteTokenizer

    docs = [("a", "x" * 2000), ("b", "y" * 700)]  # 10 held-out rows of 64; 200 tokens ask for 4
    rows = {k: prepare_data(docs, (), ByteTokenizer(), 63, k, 200, "t", eval_pieces=8).heldout
            for k in (1, 2, 4)}
    assert all(torch.equal(r, rows[1]) for r in rows.values()) and rows[1].shape[0] == 8  # not 4 (nor 3 or 5)
    with pytest.raises(FinetuneInputError,
                       match="--invariant-units 16: the held-out text gives fewer than 16"):
        prepare_data(docs, (), ByteTokenizer(), 63, 2, 2000, "t", eval_pieces=16)

def _launch(out: Path, text: Path, name: str, nproc: int, *flags: str) -> subprocess.Popen:
    argv = [*TINY, "--text", str(text), "--nproc", str(nproc), *RUN, "--summary-json",
            str(out / f"{name}.json"), "--export", str(out / f"{name}.gguf"), *flags]
    return subprocess.Popen([sys.executable, "-m", "perparam.cli", "finetune", *argv], cwd=REPO,
                            env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _done(out: Path, name: str, proc: subprocess.Popen) -> dict:
    log, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, log
    summary = json.loads((out / f"{name}.json").read_text())
    summary["gguf_sha256"] = hashlib.sha256((out / f"{name}.gguf").read_bytes()).hexdigest()
    return summary


@pytest.fixture(scope="module")
def straight(tmp_path_factory, text_dir):
    """``{1: summary, 4: summary}``: the uninterrupted runs at ``--nproc 1`` and ``4`` (launched together),
    the second saving at steps 2 and 4."""
    pytest.importorskip("gguf")
    out = tmp_path_factory.mktemp("inv")
    procs = {1: _launch(out, text_dir, "k1", 1),
             4: _launch(out, text_dir, "k4", 4, "--save", str(out / "ck4"), "--save-every", "2")}
    runs = {k: _done(out, f"k{k}", p) for k, p in procs.items()}
    return {**runs, "dir": out, "text": text_dir}


def _keys(summary: dict) -> dict:
    return {k: summary[k] for k in ("train_losses", "grad_norms", "heldout_losses", "gguf_sha256")}


@pytest.mark.fast
def test_nproc_1_and_4_write_the_same_losses_heldout_losses_and_gguf_bit_for_bit(straight):
    one, four = _keys(straight[1]), _keys(straight[4])
    assert one == four  # floats from JSON: equal bits
    assert len(one["train_losses"]) == 4 and [s for s, _ in one["heldout_losses"]] == [0, 2, 4]


def _checkpoint(folder: Path, tmp: Path) -> dict:
    """The checkpoint's model and optimizer tensors (one process, no process group) and its manifest extra."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = tmp / f"{folder.parent.name}.pt"
    dcp_to_torch_save(folder, flat)
    state = torch.load(flat, weights_only=False)
    extra = json.loads((folder / "perparam_checkpoint.json").read_text())["extra"]
    return {"state": state, "extra": extra}


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if torch.is_tensor(a):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8),
                                                                         b.view(-1).view(torch.uint8))
    return a == b


def test_saved_at_nproc_4_resumed_at_nproc_2_ends_on_the_uninterrupted_runs_losses_gguf_and_checkpoint(
        straight):
    out = straight["dir"]
    resumed = _done(out, "r2",
                    _launch(out, straight["text"], "r2", 2, "--resume", str(out / "ck4" / "step-000002"),
                            "--save", str(out / "ckr")))
    four = straight[4]
    assert resumed["first_step"] == 2
    assert (resumed["train_losses"] == four["train_losses"][2:]
            and resumed["grad_norms"] == four["grad_norms"][2:])
    assert resumed["heldout_losses"] == four["heldout_losses"][1:]  # from step 2 (the resumed model) on
    assert resumed["gguf_sha256"] == four["gguf_sha256"]
    a, b = _checkpoint(out / "ck4" / "step-000004", out), _checkpoint(out / "ckr" / "step-000004", out)
    assert len(a["state"]) > 0 and _same(a, b)
