"""``perparam.checkpoint.save``/``async_save`` never delete what is not theirs: a folder that is not a
perparam checkpoint, a file, ``""`` or ``.`` is refused on every rank before anything is written (the ranks
agree, also on paths that differ between them); ``keep`` keeps exactly that many checkpoints of the series, is
refused below 1, and prunes nothing that is not a perparam checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from perparam import checkpoint
from perparam.checkpoint import CheckpointError
from tests.checkpoint_cases import build, saved
from tests.distributed import run_distributed

USER_FILES = {"notes.txt": "my notes", "metrics.csv": "step,loss\n1,0.5\n"}


def user_folders(root: Path) -> dict[str, Path]:
    """What a user keeps where a save may be pointed: a folder of notes, a file, a folder named like the
    series, a checkpoint folder the user added a file to."""
    (root / "notes").mkdir()
    for name, text in USER_FILES.items():
        (root / "notes" / name).write_text(text)
    (root / "file.pt").write_text("a user's file")
    (root / "step-7").mkdir()
    (root / "step-7" / "notes.txt").write_text("not a checkpoint, named like one")
    return {"folder": root / "notes", "file": root / "file.pt"}


def listing(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"/"
            for p in sorted(root.rglob("*"))}


def refusals(rank: int, world_size: int, root: str, kind: str, mode: str) -> dict:
    """Every bad target (and keep value) tried in turn; each one's message on this rank (or "written")."""
    model, opt = build(rank, world_size, kind)
    root = Path(root)
    targets = {"folder": root / "notes", "file": root / "file.pt", "empty string": "", "dot": ".",
               "per-rank path": root / f"rank-{rank}"}
    targets.update({f"keep={k!r}": (root / "step-1", k) for k in (0, -1, 1.5, True)})
    out = {}
    for what, target in targets.items():
        path, keep = target if isinstance(target, tuple) else (target, 2)
        try:
            saved(model, path, opt, mode, keep=keep)
            out[what] = "written"
        except CheckpointError as e:
            out[what] = str(e)
    return out


@pytest.mark.parametrize("world_size,kind,mode", [
    pytest.param(1, "adamw", "sync", marks=pytest.mark.fast), (2, "adamw", "async"), (3, "owner", "sync"),
    (2, "owner", "async")])
def test_a_folder_that_is_not_a_checkpoint_a_file_and_empty_paths_are_refused_on_every_rank(
        tmp_path, world_size, kind, mode):
    user_folders(tmp_path)
    before = listing(tmp_path)
    got = run_distributed(refusals, world_size, str(tmp_path), kind, mode)
    want = {"folder": "notes is a folder that is not a perparam checkpoint (it holds metrics.csv, notes.txt)",
            "file": "file.pt is a file, not a perparam checkpoint", "empty string": "the path '' is empty",
            "dot": "'.' names no folder of its own", "keep=0": "keep=0: pass how many",
            "keep=-1": "keep=-1: pass", "keep=1.5": "keep=1.5: pass", "keep=True": "keep=True: pass"}
    if world_size > 1:
        want["per-rank path"] = "the ranks were given different paths"
    for rank, messages in enumerate(got):
        for what, fragment in want.items():
            assert (fragment in messages[what]
                    and "Nothing was written" in messages[what]), (rank, what, messages[what])
            assert "\n" not in messages[what]
    assert got == [got[0]] * world_size  # every rank the same message
    after = listing(tmp_path)
    if world_size == 1:
        after.pop("rank-0")
        after = {k: v for k, v in after.items() if not k.startswith("rank-0/")}
    assert after == before  # nothing written, renamed or removed (no hidden .old-* either)


def keep_series(rank: int, world_size: int, root: str, mode: str) -> list[list[str]]:
    model, opt = build(rank, world_size, "adamw")
    root = Path(root)
    seen = []
    for step, keep in ((1, 3), (2, 3), (3, 3), (4, 3), (5, 1), (6, 2), (7, None)):
        name = f"step-{step}" if step != 7 else "step-8"
        saved(model, root / name, opt, mode, keep=keep)
        seen.append(sorted(os.listdir(root)))
    return seen


@pytest.mark.parametrize("world_size,mode", [pytest.param(1, "sync", marks=pytest.mark.fast), (2, "async")])
def test_keep_keeps_exactly_that_many_checkpoints_and_never_prunes_anything_else(tmp_path, world_size, mode):
    user_folders(tmp_path)
    checkpoint.save(tmp_path / "step-0", *build(0, 0, "adamw"), keep=None)  # the oldest of the series, but
    # the user added a file: no longer only a checkpoint
    (tmp_path / "step-0" / "notes.txt").write_text("mine")
    got = run_distributed(keep_series, world_size, str(tmp_path), mode)[0]
    user = ["file.pt", "notes", "step-0", "step-7"]
    assert got == [sorted(user + s)
                   for s in (["step-1"], ["step-1", "step-2"], ["step-1", "step-2", "step-3"],
                              ["step-2", "step-3", "step-4"], ["step-5"], ["step-5", "step-6"],
                              ["step-5", "step-6", "step-8"])]
    assert listing(tmp_path / "notes") == {k: v.encode() for k, v in USER_FILES.items()}
    assert (tmp_path / "step-0" / "notes.txt").read_text() == "mine"


def test_an_empty_folder_and_an_existing_checkpoint_are_written_over(tmp_path):
    model, opt = build(0, 0, "adamw")
    (tmp_path / "empty").mkdir()
    checkpoint.save(tmp_path / "empty", model, opt)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.head.weight.add_(1.0)
    checkpoint.save(tmp_path / "empty", model, opt)  # replaced: a perparam checkpoint
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]
    fresh, fresh_opt = build(0, 0, "adamw")
    checkpoint.load(tmp_path / "empty", fresh, fresh_opt)
    assert torch.equal(fresh.head.weight, before["head.weight"] + 1.0)
