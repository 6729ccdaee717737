"""perparam.elastic: in-memory snapshots restored exactly (same K bitwise, another K through DCP's reslicing),
a lost node's shards taken from their replicas, torn and corrupted slots never loaded."""

from __future__ import annotations

import os
import uuid

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from perparam.elastic import SnapshotError, State
from tests.distributed import run_distributed
from tests.models import make_batches, sharded_tiny, train_steps

BATCH = 12
STEPS = 6


def build(world_size: int, layout: str = "1d"):
    mesh = (init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
            if layout == "hsdp" else init_device_mesh("cpu", (world_size,)))
    model = sharded_tiny(mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def everything(model, opt) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"model.{k}": _full(v) for k, v in model.state_dict().items()}
    for p, state in opt.state.items():
        out.update({f"optim.{names[id(p)]}.{k}": _full(v) for k, v in state.items()})
    return out


def run(rank: int, world_size: int, root: str, job: str, stop_after: int | None, layout: str = "1d",
        replica: str = "always") -> dict:
    """Restore (if any), then train to STEPS committing after each step; ``stop_after``: return after that
    many steps of this incarnation, as a killed run would (its slots stay). ``replica="always"``: the replica
    path even on this one host."""
    model, opt, sched = build(world_size, layout)
    state = State(model, opt, sched, root=root, job=job, seen=0, replica=replica)
    start = state.restore()
    losses = []
    for i, batch in enumerate(make_batches(STEPS, BATCH)[start:]):
        losses += [x.item() for x in train_steps(model, opt, [batch], rank, world_size)]
        sched.step()
        state.seen += BATCH
        state.commit()
        if stop_after is not None and i + 1 == stop_after:
            state.finish()
            break
    out = {"start": start, "losses": losses, "state": everything(model, opt), "lr": opt.param_groups[0]["lr"],
           "seen": state.seen, "bytes": state.bytes_mapped()}
    state.close(remove_snapshots=stop_after is None)
    return out


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("straight"))
    return {w: run_distributed(run, w, root, uuid.uuid4().hex, None) for w in (2, 4)}


@pytest.mark.parametrize("before,after", [(2, 2), (4, 4), (2, 4), (4, 2)])
def test_restore_continues_as_the_uninterrupted_run(tmp_path, straight, before, after):
    job = uuid.uuid4().hex
    first = run_distributed(run, before, str(tmp_path), job, 3)
    assert first[0]["start"] == 0
    got = run_distributed(run, after, str(tmp_path), job, None)
    want = straight[after]
    assert got[0]["start"] == 3 and got[0]["seen"] == STEPS * BATCH
    assert got[0]["lr"] == want[0]["lr"]
    for key, value in want[0]["state"].items():
        if before == after:
            assert torch.equal(got[0]["state"][key], value), key
        else:  # resumed on another K: the steps after the restore reduce in another order
            torch.testing.assert_close(got[0]["state"][key], value, rtol=0, atol=1e-5)
    if before == after:
        assert [r["losses"] for r in got] == [r["losses"][3:] for r in want]


def lose_node(folder, node_ranks: set[int]) -> list[str]:
    """Delete what a node of ``node_ranks`` held in memory: those ranks' own slots and the replicas they
    held."""
    gone = []
    for path in sorted(folder.iterdir()):
        origin, kind = path.name.split("-")[:2]
        holder = int(origin[1:]) if kind == "own" else int(kind[2:])
        if holder in node_ranks:
            path.unlink()
            gone.append(path.name)
    return gone


def two_nodes(rank: int, world_size: int, *args) -> dict:
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # ranks 0-1 and 2-3 are two nodes: each replica on the other node
    return run(rank, world_size, *args, "1d", "auto")  # "auto" keeps replicas: the job spans two nodes


@pytest.mark.parametrize("after", [4, 2])
def test_a_lost_nodes_shards_come_from_their_replicas(tmp_path, straight, after):
    job = uuid.uuid4().hex
    run_distributed(two_nodes, 4, str(tmp_path), job, 3)
    gone = lose_node(tmp_path / job, {2, 3})
    assert "r2-own-s1" in gone and "r0-by2-s1" in gone
    got = run_distributed(run, after, str(tmp_path), job, None)
    assert got[0]["start"] == 3
    for key, value in straight[after][0]["state"].items():
        if after == 4:
            assert torch.equal(got[0]["state"][key], value), key
        else:
            torch.testing.assert_close(got[0]["state"][key], value, rtol=0, atol=1e-5)


def lose_and_restore(rank: int, world_size: int, root: str, job: str) -> str:
    model, opt, sched = build(world_size)
    state = State(model, opt, sched, root=root, job=job, seen=0, replica="always")
    try:
        state.restore()
    except SnapshotError as e:
        return str(e)
    finally:
        state.close(remove_snapshots=False)
    return "restored"


def test_a_shard_lost_with_its_replica_stops_with_one_line_on_every_rank(tmp_path):
    job = uuid.uuid4().hex
    run_distributed(two_nodes, 4, str(tmp_path), job, 3)
    lose_node(tmp_path / job, {2, 3})
    for name in ("r3-by1-s0", "r3-by1-s1"):  # and the replica of rank 3
        (tmp_path / job / name).unlink()
    lines = run_distributed(lose_and_restore, 4, str(tmp_path), job)
    assert len(set(lines)) == 1 and "\n" not in lines[0]
    assert lines[0].startswith("no complete in-memory snapshot: rank(s) [3] of the newest (step 3, 4 ranks)")
    assert "resume from your last disk checkpoint" in lines[0]


def test_every_copy_of_a_rank_refused_by_its_checksum_names_that_rank(tmp_path):
    job = uuid.uuid4().hex
    run_distributed(run, 2, str(tmp_path), job, 3)
    for name in ("r1-own-s0", "r1-own-s1", "r1-by0-s0", "r1-by0-s1"):  # headers whole, payloads damaged
        flip(tmp_path / job / name, 4096 + 8000)
    lines = run_distributed(lose_and_restore, 2, str(tmp_path), job)
    assert lines[0] == lines[1]
    assert lines[0].startswith("no complete in-memory snapshot: rank(s) [1] of the newest (step 3, 2 ranks)")


def flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damaged,start", [
    (("r0-own-s1",), 3),  # its replica (held by rank 1) passes: step 3 still restored
    (("r0-own-s1", "r0-by1-s1"), 2),  # both copies of rank 0's step 3 refused: step 2, the other slot
    (("r1-own-s1@header", "r1-by0-s1@header"), 2),  # a damaged header: refused as well
])
def test_a_corrupted_slot_is_refused_by_its_checksum(tmp_path, straight, damaged, start):
    job = uuid.uuid4().hex
    run_distributed(run, 2, str(tmp_path), job, 3)
    for name in damaged:
        name, _, where = name.partition("@")
        flip(tmp_path / job / name, 20 if where == "header" else 4096 + 8000)  # a tensor byte of the payload
    got = run_distributed(run, 2, str(tmp_path), job, None)
    assert got[0]["start"] == start
    for key, value in straight[2][0]["state"].items():  # the lost step is rerun: the same bits at the end
        assert torch.equal(got[0]["state"][key], value), key


def one_host(rank: int, world_size: int, root: str, job: str, replica: str) -> dict:
    model, opt, sched = build(world_size)
    state = State(model, opt, sched, root=root, job=job, replica=replica)
    train_steps(model, opt, make_batches(1, BATCH), rank, world_size)
    state.commit()
    state.finish()
    own = state.store.own(1).capacity
    out = {"replica": state.replica, "mapped": state.bytes_mapped(), "own": own}
    state.close(remove_snapshots=False)
    return out


@pytest.mark.parametrize("replica,kept", [("auto", False), ("always", True), ("off", False)])
def test_a_job_on_one_host_keeps_a_replica_only_when_told_to(tmp_path, replica, kept):
    job = uuid.uuid4().hex
    got = run_distributed(one_host, 2, str(tmp_path), job, replica)
    held = sorted(p.name for p in (tmp_path / job).iterdir() if "-by" in p.name)
    assert [g["replica"] for g in got] == [kept, kept]
    assert held == (["r0-by1-s1", "r1-by0-s1"] if kept else [])
    # memory: the own slot, plus the other rank's when a replica is kept (one commit:
    for r, g in enumerate(got):
        assert g["mapped"] == g["own"] + (got[1 - r]["own"] if kept else 0)  # one slot of each)
