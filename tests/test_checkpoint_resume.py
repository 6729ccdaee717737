"""perparam.checkpoint: save on one world size or mesh, load on another bit-exactly, resume exactly, survive a
rank killed mid-save, refuse incomplete, foreign and mismatched checkpoints before touching anything."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import perparam
from perparam import checkpoint
from perparam.checkpoint import CheckpointError
from tests.distributed import one_process, run_distributed
from tests.models import TinyNet, make_batches, train_steps

BATCH = 12


class WithUnused(TinyNet):
    """TinyNet plus a layer no forward uses: its parameters never get a gradient, so AdamW never creates
    their state."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(3, 3)


def build(world_size: int, layout: str = "1d"):
    torch.manual_seed(0)
    model = WithUnused()
    if layout == "single":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)
    mesh = (init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
            if layout == "hsdp" else init_device_mesh("cpu", (world_size,)))
    for block in model.blocks:
        perparam.fully_shard(block, mesh=mesh)
    perparam.fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def steps(model, opt, batches, rank: int, world_size: int) -> list[float]:
    return [loss.item() for loss in train_steps(model, opt, batches, rank, world_size)]


def _full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def snapshot(model, opt) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"model.{k}": _full(v) for k, v in model.state_dict().items()}
    for p, state in opt.state.items():
        out.update({f"optim.{names[id(p)]}.{k}": _full(v) for k, v in state.items()})
    return out


def save_after(rank: int, world_size: int, path: str, n: int) -> dict:
    model, opt = build(world_size)
    steps(model, opt, make_batches(n, BATCH), rank, world_size)
    checkpoint.save(path, model, opt, extra={"step": n})
    return snapshot(model, opt)


def load_into(rank: int, world_size: int, path: str, layout: str) -> dict:
    model, opt = build(world_size, layout)
    extra = checkpoint.load(path, model, opt)
    model.blocks[0].fc1.weight.requires_grad_(False)  # frozen after the save: its state is kept
    return {"extra": extra, "state": snapshot(model, opt)}


@pytest.fixture(scope="module")
def saved_on_4(tmp_path_factory) -> tuple[str, dict]:
    """A checkpoint saved on 4 ranks after 3 steps and rank 0's snapshot of the state it holds; saved once for
    the module (loading only reads it)."""
    path = str(tmp_path_factory.mktemp("saved_on_4") / "ckpt")
    return path, run_distributed(save_after, 4, path, 3)[0]


@pytest.mark.parametrize("world,layout", [(2, "1d"), (4, "hsdp"), (0, "single")])
def test_saved_on_4_ranks_loads_bit_exact_on_2_ranks_hsdp_and_one_unsharded_process(
        saved_on_4, world, layout):
    path, saved = saved_on_4
    assert not any(k.startswith("optim.unused.") for k in saved)  # never got a gradient: no state
    got = (run_distributed(load_into, world, path, layout)[0] if world
           else one_process(load_into, path, layout))
    assert got["extra"] == {"step": 3}
    assert got["state"].keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(got["state"][key], value), key


def resume(rank: int, world_size: int, path: str) -> list[float]:
    model, opt = build(world_size)
    start = checkpoint.load(path, model, opt)["step"]
    return steps(model, opt, make_batches(10, BATCH)[start:], rank, world_size)


def straight(rank: int, world_size: int) -> list[float]:
    model, opt = build(world_size)
    return steps(model, opt, make_batches(10, BATCH), rank, world_size)


@pytest.fixture(scope="module")
def straight_and_saved_at_5(tmp_path_factory) -> tuple[list, str]:
    """The uninterrupted 10-step run's per-rank losses on 4 ranks, and a checkpoint of another 4-rank run
    saved after step 5; made once for the module (resuming only reads the checkpoint)."""
    path = str(tmp_path_factory.mktemp("saved_at_5") / "ckpt")
    want = run_distributed(straight, 4)
    run_distributed(save_after, 4, path, 5)
    return want, path


@pytest.mark.parametrize("resume_world", [4, 2])
def test_resume_continues_exactly_as_the_uninterrupted_run(straight_and_saved_at_5, resume_world):
    want, path = straight_and_saved_at_5
    got = run_distributed(resume, resume_world, path)
    # fp32, same world: bitwise. Another world size reduces in another order: within 1e-6
    mean = [sum(r[i] for r in got) / resume_world for i in range(5)]
    want_mean = [sum(r[5 + i] for r in want) / 4 for i in range(5)]
    if resume_world == 4:
        assert [r[5:] for r in want] == got
    assert max(abs(a - b) for a, b in zip(mean, want_mean)) <= 1e-6


def die_during_save(rank: int, world_size: int, path: str, dying: int = 1) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    model, opt = build(world_size)
    steps(model, opt, make_batches(1, BATCH), rank, world_size)
    if rank == dying:
        original = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            original(self, plan, planner).wait()
            os._exit(3)  # killed between writing its files and the end of the save

        FileSystemWriter.write_data = write_then_die
    checkpoint.save(path, model, opt, extra={"step": 1})


def load_extra(rank: int, world_size: int, path: str):
    model, opt = build(world_size)
    return checkpoint.load(path, model, opt)


@pytest.mark.parametrize("dying", [0, 1])
def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path, dying):
    path = str(tmp_path / "ckpt")
    run_distributed(save_after, 2, path, 2)
    with pytest.raises(AssertionError):
        run_distributed(die_during_save, 2, path, dying, timeout=60)
    partial = [p for p in os.listdir(tmp_path) if p.startswith(".ckpt.tmp-")]
    assert run_distributed(load_extra, 2, path) == [{"step": 2}] * 2
    if dying == 1:  # rank 0 saw the save fail and removed the partial folder
        assert not partial, os.listdir(tmp_path)
        return
    assert partial, os.listdir(tmp_path)
    with pytest.raises(CheckpointError, match="not a complete perparam checkpoint"):
        checkpoint.load(tmp_path / partial[0], *build(0, "single"))
    run_distributed(save_after, 2, path, 3)  # the next save cleans the leftover
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".ckpt.tmp-")]


def test_mismatched_missing_and_foreign_checkpoints_are_refused_before_anything_changes(tmp_path):
    path = tmp_path / "ckpt"
    run_distributed(save_after, 2, str(path), 1)
    torch.manual_seed(1)
    other = TinyNet(d=8)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(path, other, torch.optim.AdamW(other.parameters()))
    for fragment in ("'unused.weight' is in the checkpoint", "'blocks.0.fc1.weight' was saved as float32[",
                     "Nothing"):
        assert fragment in str(e.value), str(e.value)
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.load(tmp_path / "nowhere", other)
    # a manifest beside a metadata pickle that would run code: refused, nothing unpickled
    with open(path / ".metadata", "wb") as f:
        pickle.dump(os.system, f)
    model, opt = build(0, "single")
    with pytest.raises(checkpoint.CheckpointDamagedError,
                       match=r"damaged: \.metadata is truncated: 31 of the"):
        checkpoint.load(path, model, opt)  # the checksum finds it first
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        checkpoint.load(path, model, opt, verify=False)


def test_keep_retains_the_newest_checkpoints_and_extra_must_be_json(tmp_path):
    model, opt = build(0, "single")
    for step in range(4):
        checkpoint.save(tmp_path / f"step-{step}", model, opt, extra={"step": step}, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step-2", "step-3"]
    assert checkpoint.latest(tmp_path) == tmp_path / "step-3"
    assert json.loads((tmp_path / "step-3" / checkpoint.MANIFEST).read_text())["extra"] == {"step": 3}
    with pytest.raises(CheckpointError, match="JSON"):
        checkpoint.save(tmp_path / "bad", model, opt, extra={"tensor": torch.ones(1)})
    assert not dist.is_initialized()


def rank_dependent(rank: int, world_size: int, path: str, what: str) -> str:
    model, opt = build(world_size)
    extra = {"rank": rank} if what == "extra" else {}
    if what == "buffer":
        model.register_buffer("seen", torch.tensor([float(rank)]))
    if what == "buffer_on_rank_0" and rank == 0:  # rank 1 holds nothing to compare: it must refuse too
        model.register_buffer("seen", torch.ones(1))
    try:
        checkpoint.save(path, model, opt, extra=extra)
    except CheckpointError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("what", ["extra", "buffer", "buffer_on_rank_0"])
def test_state_that_differs_between_ranks_is_refused_rather_than_saved_as_rank_0s(tmp_path, what):
    for message in run_distributed(rank_dependent, 2, str(tmp_path / "ckpt"), what):
        assert "differ between ranks" in message and ("extra" in message or "seen" in message), message
    assert not (tmp_path / "ckpt").exists()


def optimizer_first(rank: int, world_size: int, path: str) -> list[float]:
    torch.manual_seed(0)
    model = WithUnused()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built before fully_shard
    perparam.fully_shard(model)
    checkpoint.load(path, model, opt)
    return steps(model, opt, make_batches(4, BATCH)[2:], rank, world_size)


def test_an_unsharded_checkpoint_resumes_into_a_sharded_model_with_an_optimizer_built_first(tmp_path):
    path = tmp_path / "plain"
    model, opt = build(0, "single")
    steps(model, opt, make_batches(2, BATCH), 0, 0)
    checkpoint.save(path, model, opt, extra={"step": 2})
    want = steps(model, opt, make_batches(4, BATCH)[2:], 0, 0)
    got = run_distributed(optimizer_first, 2, str(path))
    mean = [sum(r[i] for r in got) / 2 for i in range(2)]
    assert max(abs(a - b) for a, b in zip(mean, want)) <= 1e-6


def test_keep_prunes_only_its_own_series_and_damage_is_a_checkpoint_error(tmp_path):
    model, opt = build(0, "single")
    for name in ("init", "best", "step-1", "step-2", "step-3"):
        checkpoint.save(tmp_path / name, model, opt, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["best", "init", "step-2", "step-3"]
    for f in (tmp_path / "step-3").glob("*.distcp"):
        f.write_bytes(f.read_bytes()[:10])
    with pytest.raises(checkpoint.CheckpointDamagedError,
                       match=r"is damaged: __0_0\.distcp is truncated: 10 of the"):
        checkpoint.load(tmp_path / "step-3", model, opt)
    os.rename(tmp_path / "best", tmp_path / ".best.old-abc")  # killed between the two renames of a save
    with pytest.raises(CheckpointError, match="intact at"):
        checkpoint.load(tmp_path / "best", model, opt)
