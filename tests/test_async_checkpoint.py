"""perparam.checkpoint.async_save: returns once the state is copied, writes on its own process group while
training goes on, loads bit-exactly (1D, and HSDP over 2 replicas), survives a rank killed during the write,
chains saves, and reports a failed write at the next wait or save on every rank."""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

import perparam
from perparam import ParamPolicy, checkpoint
from perparam.checkpoint import CheckpointError
from perparam.checkpoint import background as checkpoint_async
from tests.distributed import run_distributed
from tests.models import TinyNet, local_slice, make_batches

BATCH = 4


class Scaled(TinyNet):
    """TinyNet (empty shards of ``Linear(d, 2)`` on 3-4 ranks) times a 0-dim parameter, whose DTensor DCP's
    own stager would not copy."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, idx):
        return self.scale * super().forward(idx)


def build(world_size: int, layout: str = "1d"):
    torch.manual_seed(0)
    model = Scaled()
    mesh = (init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
            if layout == "hsdp" else init_device_mesh("cpu", (world_size,)))
    for block in model.blocks:
        perparam.fully_shard(block, mesh=mesh)
    perparam.fully_shard(model, mesh=mesh, param_policy={"scale": ParamPolicy(placement=Replicate())})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model, opt, n: int, rank: int, world_size: int, seed: int = 0) -> None:
    for x, y in make_batches(n, BATCH, seed):
        F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
        opt.step()
        opt.zero_grad()


def state_of(model, opt) -> dict:
    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"model.{k}": full(v) for k, v in model.state_dict().items()}
    for p, state in opt.state.items():
        out.update({f"optim.{names[id(p)]}.{k}": full(v) for k, v in state.items()})
    return out


def loaded(rank: int, world_size: int, path: str, layout: str = "1d") -> dict:
    model, opt = build(world_size, layout)
    extra = checkpoint.load(path, model, opt)
    return {"extra": extra, "state": state_of(model, opt)}


def assert_equal_states(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def save_async_then_train(rank: int, world_size: int, path: str, layout: str) -> dict:
    """async_save, then a training step while the write is held back: the step's collectives run on the
    default group while the checkpoint's are in flight on its own; the checkpoint holds the state at the
    call."""
    model, opt = build(world_size, layout)
    train(model, opt, 2, rank, world_size)
    saved = state_of(model, opt)
    release = threading.Event()
    original = FileSystemWriter.write_data

    def held_back(self, plan, planner):
        release.wait(60)
        return original(self, plan, planner)

    FileSystemWriter.write_data = held_back
    try:
        pending = checkpoint.async_save(path, model, opt, extra={"step": 2})
        train(model, opt, 1, rank, world_size, seed=1)  # changes every parameter, 0-dim scale included
        in_flight = not pending.done()
        with pytest.raises(TimeoutError):
            pending.wait(timeout_s=0.01)  # still held back: the handle stays usable
        release.set()
        assert pending.wait() == pending.path
    finally:
        FileSystemWriter.write_data = original
        release.set()
    return {"saved": saved, "in_flight": in_flight, "after": state_of(model, opt),
            "loaded": loaded(rank, world_size, path, layout)}


@pytest.mark.fast
def test_async_save_snapshots_the_state_while_training_continues_and_loads_bit_exact(tmp_path):
    path = str(tmp_path / "ckpt")
    got = run_distributed(save_async_then_train, 2, path, "1d")[0]
    assert got["in_flight"]  # the training step ran while the write had not finished
    assert not torch.equal(got["after"]["model.scale"], got["saved"]["model.scale"])
    assert got["loaded"]["extra"] == {"step": 2}
    assert_equal_states(got["loaded"]["state"], got["saved"])  # the state at the call, not the step after it


def three_in_a_row(rank: int, world_size: int, folder: str) -> list:
    model, opt = build(world_size, "hsdp")  # 2 replicas x 1 shard: DCP writes each replicated shard once
    states, groups = [], set()
    for step in (1, 2, 3):
        train(model, opt, 1, rank, world_size, seed=step)
        states.append(state_of(model, opt))
        pending = checkpoint.async_save(f"{folder}/step-{step:06d}", model, opt, extra={"step": step}, keep=2)
        groups.add(checkpoint_async.checkpoint_group())
    (group,) = groups  # made by the first save, reused by the next ones
    assert pending.wait().name == "step-000003"
    checkpoint.wait_pending()  # nothing left: returns at once
    # the training group's timeout (the harness's 120 s), not gloo's 30-minute default
    assert (checkpoint_async._timeout_of(group) == timedelta(seconds=120)
            == checkpoint_async._timeout_of(dist.group.WORLD))
    return [states, [loaded(rank, world_size, f"{folder}/step-{step:06d}", "hsdp") for step in (2, 3)]]


def test_async_saves_in_a_row_on_an_hsdp_mesh_wait_for_each_other_keep_the_newest_and_load_bit_exact(
        tmp_path):
    states, got = run_distributed(three_in_a_row, 2, str(tmp_path))[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002", "step-000003"]
    for step, one in zip((2, 3), got):
        assert one["extra"] == {"step": step}
        assert_equal_states(one["state"], states[step - 1])


def save_then_async(rank: int, world_size: int, path: str, fail: str) -> str:
    model, opt = build(world_size)
    train(model, opt, 1, rank, world_size)
    checkpoint.save(path, model, opt, extra={"step": 1})
    train(model, opt, 1, rank, world_size, seed=1)
    if rank == 1:
        original = FileSystemWriter.write_data

        def broken(self, plan, planner):
            if fail == "die":
                original(self, plan, planner).wait()
                os._exit(3)  # killed between writing its files and the end of the save
            raise OSError(28, "No space left on device")

        FileSystemWriter.write_data = broken
    pending = checkpoint.async_save(path, model, opt, extra={"step": 2})
    train(model, opt, 1, rank, world_size, seed=2)  # the caller goes on at once
    with pytest.raises(CheckpointError, match="background save of .*ckpt failed") as raised:
        checkpoint.save(path, model, opt, extra={"step": 3})  # waits for the failed write first
    checkpoint.wait_pending()  # reported once by the waits of the series...
    with pytest.raises(CheckpointError, match="No space left"):
        pending.wait()  # ...while the handle itself always tells the truth
    return {"message": str(raised.value), "loaded": loaded(rank, world_size, path)["extra"]}


def test_a_failed_background_write_is_raised_by_the_next_save_on_every_rank(tmp_path):
    path = str(tmp_path / "ckpt")
    for got in run_distributed(save_then_async, 2, path, "raise"):
        assert ("No space left on device" in got["message"]
                and "previous checkpoint is unchanged" in got["message"])
        assert got["loaded"] == {"step": 1}


def test_a_rank_killed_during_the_background_write_leaves_the_previous_checkpoint_loadable(tmp_path):
    path = str(tmp_path / "ckpt")
    with pytest.raises(AssertionError, match="rank 1"):
        # grace: rank 0 reports only after it removed the partial folder (seconds on a loaded host)
        run_distributed(save_then_async, 2, path, "die", timeout=60, grace=50)
    # rank 0 saw the failure: removed
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".ckpt.tmp-")]
    assert run_distributed(loaded, 2, path)[0]["extra"] == {"step": 1}


def test_async_save_without_a_process_group_writes_and_loads_and_refuses_bad_extra_at_once(tmp_path):
    assert not dist.is_initialized()
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    with pytest.raises(CheckpointError, match="extra must be JSON-serialisable"):
        checkpoint.async_save(tmp_path / "bad", model, extra={"step": object()})  # before any copy or thread
    assert not (tmp_path / "bad").exists()
    pending = checkpoint.async_save(tmp_path / "one", model, extra={"step": 0})
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    assert pending.wait() == tmp_path / "one"
    checkpoint.load(tmp_path / "one", model)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items())


def _snapshot_keeps_specs(rank: int, world_size: int) -> dict:
    from torch.distributed.tensor import DTensor

    from perparam.checkpoint.background import snapshot

    model = nn.Linear(3, 5)
    perparam.fully_shard(model)
    state = model.state_dict()
    snap = snapshot(state)
    return {k: (isinstance(v, DTensor) and v._spec is state[k]._spec, v.to_local().device.type,
                v.to_local().data_ptr() != state[k].to_local().data_ptr() or not v.to_local().numel(),
                torch.equal(v.full_tensor(), state[k].full_tensor())) for k, v in snap.items()}


def test_the_async_snapshot_wraps_host_copies_in_the_original_spec_with_no_move_back_to_the_mesh_device():
    for r in run_distributed(_snapshot_keeps_specs, 2):
        assert r == {"weight": (True, "cpu", True, True), "bias": (True, "cpu", True, True)}
