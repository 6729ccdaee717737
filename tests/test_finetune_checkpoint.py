"""``perparam finetune --save/--resume``: a run saved at step 2 and resumed (on the same or another number of
ranks) continues exactly where the uninterrupted run is; bad --resume folders stop with one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from perparam.cli import main
from tests.finetune_helpers import TINY, run_finetune

pytestmark = pytest.mark.slow


def _run(tmp: Path, text: Path, name: str, *flags: str, nproc: int = 2) -> dict:
    out = tmp / f"{name}.json"
    proc = run_finetune(*TINY, "--text", str(text), "--nproc", str(nproc), *flags, "--summary-json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


def test_save_at_step_2_then_resume_equals_the_uninterrupted_run(tmp_path, text_dir, plain_tiny_run):
    text = text_dir
    _, straight = plain_tiny_run  # the uninterrupted run: TINY on 2 ranks (conftest.py, shared)
    ckpt = tmp_path / "ckpt"
    first = _run(tmp_path, text, "first", "--steps", "2", "--save", str(ckpt), "--save-every", "1")
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-000001", "step-000002"]
    assert first["train_losses"] == straight["train_losses"][:2]
    resumed = _run(tmp_path, text, "resumed", "--resume", str(ckpt))
    assert resumed["first_step"] == 2
    assert resumed["train_losses"] == straight["train_losses"][2:]  # fp32, same world: bitwise
    assert resumed["heldout_loss_after"] == straight["heldout_loss_after"]
    one_rank = _run(tmp_path, text, "one", "--resume", str(ckpt), nproc=1)  # another world size
    assert max(abs(a - b) for a, b in zip(one_rank["train_losses"], straight["train_losses"][2:])) <= 1e-5


def test_bad_resume_folders_stop_before_any_worker_starts(tmp_path, text_dir, capsys, monkeypatch):
    """The launcher's checks, run in this process (``perparam.cli.main``, what the console script calls): exit
    code 2 and one line, no traceback; no worker is started (a started run would train and return 0)."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    text = text_dir
    empty = tmp_path / "empty"
    empty.mkdir()
    for folder, fragment in ((tmp_path / "missing", "no such folder"), (empty, "no complete checkpoint")):
        assert main(["finetune", *TINY, "--text", str(text), "--resume", str(folder)]) == 2
        err = capsys.readouterr().err
        assert fragment in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert main(["finetune", *TINY, "--text", str(text), "--save-every", "2"]) == 2
    err = capsys.readouterr().err
    assert "--save" in err and len(err.strip().splitlines()) == 1, err


def test_resume_takes_the_newest_intact_checkpoint_and_names_what_it_skipped(
        tmp_path, text_dir, plain_tiny_run):
    """A truncated newest manifest (found by the launcher and the workers alike) and a flipped bit in the
    newest shard (found by the checksums at load, on every rank) each make --resume take step 2, saying
    so in one line; the run then continues as the uninterrupted one does."""
    import shutil

    from perparam import checkpoint
    from tests.checkpoint_cases import flip_bit

    _, straight = plain_tiny_run
    ckpt = tmp_path / "ckpt"
    _run(tmp_path, text_dir, "first", "--steps", "3", "--save", str(ckpt), "--save-every", "2")
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-000002", "step-000003"]
    flipped = tmp_path / "flipped"
    shutil.copytree(ckpt, flipped)
    manifest = ckpt / "step-000003" / checkpoint.MANIFEST
    manifest.write_text(manifest.read_text()[:200])
    flip_bit(flipped / "step-000003", "model.layers.0.")
    for folder, why in ((ckpt, "skipped step-000003 (perparam_checkpoint.json cannot be read (truncated"),
                        (flipped, "skipped step-000003 (__")):
        out = tmp_path / f"{folder.name}.json"
        proc = run_finetune(*TINY, "--text", str(text_dir), "--nproc", "2", "--resume", str(folder),
                            "--summary-json", str(out))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        lines = [line for line in proc.stdout.splitlines() if "skipped" in line]
        assert (len(lines) == 1 and why in lines[0]
                and lines[0].endswith("resuming from step-000002")), proc.stdout
        if folder == flipped:
            assert "distcp was changed in place" in lines[0], lines[0]
        resumed = json.loads(out.read_text())
        assert resumed["first_step"] == 2 and resumed["train_losses"] == straight["train_losses"][2:]


def test_a_save_folder_holding_a_users_step_folder_stops_before_any_worker_starts(tmp_path, text_dir, capsys,
                                                                                 monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    (tmp_path / "ckpt" / "step-000002").mkdir(parents=True)
    (tmp_path / "ckpt" / "step-000002" / "notes.txt").write_text("mine")
    assert main(["finetune", *TINY, "--text", str(text_dir), "--save", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert "step-000002 is a folder that is not a perparam checkpoint (it holds notes.txt)" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert (tmp_path / "ckpt" / "step-000002" / "notes.txt").read_text() == "mine"


def test_a_full_disk_during_the_background_save_is_one_line_naming_enospc(tmp_path, text_dir):
    from tests.checkpoint_cases import small_tmpfs

    with small_tmpfs(tmp_path / "disk", size="256k") as disk:
        proc = run_finetune(*TINY, "--text", str(text_dir), "--nproc", "2", "--save", str(disk / "ckpt"))
        left = sorted(os.listdir(disk / "ckpt"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "the checkpoint of step 4 could not be written" in err[0] and "ENOSPC" in err[0], err[0]
    assert "partial folder .step-000004.tmp-" in err[0] and left == [], (err[0], left)
