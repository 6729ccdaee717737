"""A damaged checkpoint is never loaded: the manifest records every file's size and SHA-256 and ``load``
checks them first (the files split between the ranks), so a flipped bit in a weight or in optimizer state
(owner parameters' included), a shard cut short, missing or overwritten, and a truncated or edited manifest
each give one line naming the file and the damage, on every rank, with nothing changed; a full disk during a
save or an async save (a real one: a small tmpfs) is named as ENOSPC and the partial folder is removed."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from perparam import checkpoint
from perparam.checkpoint import CheckpointDamagedError, CheckpointError
from tests.checkpoint_cases import build, flip_bit, saved, small_tmpfs, state, train
from tests.distributed import run_distributed


def _largest_shard(path: Path) -> Path:
    return max(sorted(path.glob("*.distcp")), key=lambda f: f.stat().st_size)


def _truncate_manifest(path: Path) -> None:
    text = (path / checkpoint.MANIFEST).read_text()
    (path / checkpoint.MANIFEST).write_text(text[:len(text) // 2])


def _edit_manifest(path: Path) -> None:
    manifest = json.loads((path / checkpoint.MANIFEST).read_text())
    manifest["extra"]["step"] = 99  # valid JSON, another value
    (path / checkpoint.MANIFEST).write_text(json.dumps(manifest))


#: each damage, and what the one line must say about it
DAMAGE = {
    "flipped weight": (lambda p, kind: flip_bit(p, "blocks.0.fc1.weight"),
                       "distcp was changed in place: the same"),
    "flipped optimizer state": (lambda p, kind: flip_bit(p, "momentum_buffer" if kind == "owner"
                                                         else "exp_avg_sq"),
                                "distcp was changed in place: the same"),
    "truncated shard": (lambda p, kind: (f := _largest_shard(p)).write_bytes(f.read_bytes()[:1000]),
                        "distcp is truncated: 1000 of the"),
    "missing shard": (lambda p, kind: _largest_shard(p).unlink(), "distcp is missing"),
    "overwritten shard": (
        lambda p, kind: (f := _largest_shard(p)).write_bytes(os.urandom(f.stat().st_size + 7)),
        "distcp was overwritten:"),
    "truncated manifest": (lambda p, kind: _truncate_manifest(p),
                           "perparam_checkpoint.json cannot be read (truncated"),
    "edited manifest": (lambda p, kind: _edit_manifest(p),
                        "perparam_checkpoint.json was changed after the save"),
}


def load_each_damaged(rank: int, world_size: int, root: str, kind: str, mode: str) -> dict:
    model, opt = build(rank, world_size, kind)
    root = Path(root)
    saved(model, root / "good", opt, mode, extra={"step": 2})
    if rank == 0:
        for how, (damage, _) in DAMAGE.items():
            shutil.copytree(root / "good", root / how)
            damage(root / how, kind)
    dist.barrier()
    out = {}
    fresh, fresh_opt = build(rank, world_size, kind)
    train(fresh, fresh_opt, rank, world_size, 1, seed=5)  # differs from the saved state
    before = state(fresh, fresh_opt) if kind != "owner" else state(fresh, [])
    for how in DAMAGE:
        try:
            checkpoint.load(root / how, fresh, fresh_opt)
            out[how] = "loaded"
        except CheckpointDamagedError as e:
            out[how] = str(e)
    after = state(fresh, fresh_opt) if kind != "owner" else state(fresh, [])
    out["unchanged"] = all(torch.equal(after[k], v) for k, v in before.items())
    # without the checksums the flipped bit loads in silence: the weight is off by ~1e37
    checkpoint.load(root / "flipped weight", fresh, fresh_opt, verify=False)
    want = state(model, [])
    out["unverified"] = max((state(fresh, [])[k] - v).abs().max().item() for k, v in want.items())
    out["good"] = checkpoint.load(root / "good", fresh, fresh_opt)
    return out


@pytest.mark.parametrize("world_size,kind,mode", [
    pytest.param(1, "adamw", "sync", marks=pytest.mark.fast), (2, "adamw", "async"), (3, "owner", "sync"),
    (2, "owner", "async")])
def test_every_damage_is_one_line_naming_the_file_on_every_rank_and_nothing_is_loaded(
        tmp_path, world_size, kind, mode):
    got = run_distributed(load_each_damaged, world_size, str(tmp_path), kind, mode)
    for rank, out in enumerate(got):
        for how, (_, fragment) in DAMAGE.items():
            message = out[how]
            assert (fragment in message and "is damaged" in message
                    and "\n" not in message), (rank, how, message)
            assert str(tmp_path / how) in message
        assert out["unchanged"], rank
        assert out["unverified"] > 1e30  # the damage the checksum finds: loaded in silence without it
        assert out["good"] == {"step": 2}
    assert all(out == got[0] for out in got[1:])  # every rank alike


def test_survey_names_the_damaged_newest_and_latest_passes_over_it_with_a_warning_naming_it(tmp_path):
    model, opt = build(0, 0, "adamw")
    for step in (2, 4):
        checkpoint.save(tmp_path / f"step-{step}", model, opt, extra={"step": step}, keep=None)
    _truncate_manifest(tmp_path / "step-4")
    found = checkpoint.survey(tmp_path)
    assert [p.name for p, _ in found] == ["step-4", "step-2"]
    assert "perparam_checkpoint.json cannot be read (truncated" in found[0][1] and found[1][1] is None
    with pytest.warns(UserWarning, match=r"passed over .*step-4: its perparam_checkpoint.json cannot be"):
        assert checkpoint.latest(tmp_path) == tmp_path / "step-2"
    # a checkpoint named itself
    assert checkpoint.survey(tmp_path / "step-2") == [(tmp_path / "step-2", None)]
    (f := _largest_shard(tmp_path / "step-2")).write_bytes(f.read_bytes()[:10])
    assert "__0_0.distcp is truncated: 10 of the" in checkpoint.survey(tmp_path)[1][1]  # sizes: no hashing


# -- a full disk ---------------------------------------------------------------------------------------------
def save_on_full_disk(rank: int, world_size: int, disk: str, kind: str, mode: str) -> dict:
    model, opt = build(rank, world_size, kind)
    disk = Path(disk)
    saved(model, disk / "step-1", opt, mode, extra={"step": 1})
    if rank == 0:  # leave 16 KiB: the next save's first file does not fit
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        with open(disk / "filler", "wb") as f:
            f.write(b"\0" * max(0, free - 16384))
    dist.barrier()
    out = {}
    try:
        saved(model, disk / "step-2", opt, mode, extra={"step": 2})
        out["full"] = "written"
    except CheckpointError as e:
        out["full"] = str(e)
    dist.barrier()
    out["left"] = sorted(os.listdir(disk))
    out["previous"] = checkpoint.load(disk / "step-1", *build(rank, world_size, kind))
    dist.barrier()
    if rank == 0:
        (disk / "filler").unlink()
    dist.barrier()
    out["after freeing"] = str(saved(model, disk / "step-2", opt, mode, extra={"step": 2}))
    return out


@pytest.mark.parametrize("world_size,kind,mode",
                         [(1, "adamw", "sync"), (2, "adamw", "async"), (2, "owner", "sync")])
def test_a_full_disk_is_named_as_enospc_and_the_partial_folder_is_removed(tmp_path, world_size, kind, mode):
    with small_tmpfs(tmp_path / "disk") as disk:
        got = run_distributed(save_on_full_disk, world_size, str(disk), kind, mode)
    for rank, out in enumerate(got):
        assert "No space left on device (ENOSPC) on the file system holding" in out["full"], (
            rank, out["full"])
        assert ("background save of" if mode == "async" else "saving") in out["full"], out["full"]
        assert "the partial folder .step-2.tmp-" in out["full"] and "was removed" in out["full"], out["full"]
        assert "\n" not in out["full"] and len(out["full"]) < 400, out["full"]
        assert out["left"] == ["filler", "step-1"], out["left"]  # no partial folder keeps the disk full
        assert out["previous"] == {"step": 1}
        assert out["after freeing"].endswith("step-2")
