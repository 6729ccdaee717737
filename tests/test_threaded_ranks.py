"""Ranks as threads of one process (torch's ``threaded`` process group, as its multi-thread test harness
and some simulators run them): nothing perparam caches per process may be shared between ranks.

Before the caches were keyed by process group, rank 1 found the reduction group rank 0 had just created
under the same group name and moved on while rank 0 waited in ``new_group`` for it (a hang at
``fully_shard``); with that fixed, one rank's optimizer step made another rank's gathered root look stale
(a counter of optimizer steps per process), so the ranks issued different backward all-gathers.
"""

from __future__ import annotations

import threading
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing._internal.distributed.multi_threaded_pg import (
    ProcessLocalGroup,
    _install_threaded_pg,
    _uninstall_threaded_pg,
)

import perparam
from tests.distributed import one_process
from tests.models import TinyNet, local_slice, make_batches

pytestmark = pytest.mark.fast

STEPS, GLOBAL_BATCH, TOL = 3, 6, 1e-5
_SEEDED = threading.Lock()  # torch's default generator is one per process: the ranks' threads share it


def run_threaded(fn, world_size: int, *args, timeout: float = 60.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks that are threads of this process, over
    torch's ``threaded`` process group; return each rank's result. A rank that raises or hangs fails."""
    results: list = [None] * world_size
    errors: dict[int, str] = {}
    world = _install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    ProcessLocalGroup.reset()
    store = dist.HashStore()

    def worker(rank: int) -> None:
        try:
            dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
            results[rank] = fn(rank, world_size, *args)
        except BaseException as exc:  # reported to the test below
            errors[rank] = traceback.format_exc()
            ProcessLocalGroup.exception_handle(exc)  # wake the peers blocked in a collective
        finally:
            if dist.distributed_c10d._world is world and dist.is_initialized():
                dist.destroy_process_group()

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(world_size)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        if not any(t.is_alive() for t in threads):
            _uninstall_threaded_pg()
        ProcessLocalGroup.reset()
    assert not stuck, f"ranks {stuck} still running after {timeout} s (threaded process group)"
    assert not errors, "\n".join(f"rank {r}:\n{tb}" for r, tb in sorted(errors.items()))
    return results


def train(rank: int, world_size: int, reshard_after_forward: bool | int | None = None,
          opt_name: str = "adamw", global_batch: int = GLOBAL_BATCH) -> dict[str, torch.Tensor]:
    """TinyNet (uneven and empty shards on 3 ranks), blocks then root sharded (the blocks with
    ``reshard_after_forward``), AdamW or SGD, ``global_batch`` rows per step; ``world_size == 0``: one
    process, unsharded. Returns the full parameters."""
    with _SEEDED:
        torch.manual_seed(0)
        model = TinyNet()
    if world_size:
        for block in model.blocks:
            perparam.fully_shard(block, reshard_after_forward=reshard_after_forward)
        perparam.fully_shard(model)
    if opt_name == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in make_batches(STEPS, global_batch):
        if world_size:
            x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: (p.full_tensor() if world_size else p).detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_as_threads_of_one_process_train_like_one_process_in_debug_mode(world_size):
    """2 and 3 thread ranks (on 3, Linear(6, 2) and Embedding(5, 6) leave empty shards), debug mode on: every
    rank's collectives carry the same descriptor (the groups' creation index is counted per rank) and the
    result matches one process."""
    want = one_process(train)
    perparam.set_debug(True)
    try:
        results = run_threaded(train, world_size)
    finally:
        perparam.set_debug(False)
    for got in results:
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=TOL, rtol=TOL, msg=name)


def test_hpz_on_thread_ranks_trains_like_one_process_in_two_runs_of_one_process():
    """hpZ (k' = 2 of 4 thread ranks), two trainings in a row in this process: each thread rank creates its
    own secondary groups (the secondary mesh was cached per process: in the second run a thread found the
    mesh a peer thread had just created, skipped its own ``new_group`` and the peers waited in theirs:
    a hang). 3 SGD steps, within 1e-5 of one process both times."""
    want = one_process(train, None, "sgd", 8)
    for run in range(2):
        for got in run_threaded(train, 4, 2, "sgd", 8, timeout=40):
            for name in want:
                torch.testing.assert_close(got[name], want[name], atol=TOL, rtol=0, msg=f"run {run}: {name}")


def _async_save_refused(rank: int, world_size: int, path: str) -> str:
    model = torch.nn.Linear(4, 2)
    perparam.fully_shard(model)
    try:
        perparam.checkpoint.async_save(path, model)
    except perparam.checkpoint.CheckpointError as e:
        return str(e)
    return "not refused"


def test_async_save_on_thread_ranks_is_refused_naming_the_blocking_save(tmp_path):
    """The background writer's process group is one per process (and DCP's collectives from a writer thread
    do not run on the threaded group): refused on every rank before anything is written, naming ``save``."""
    for message in run_threaded(_async_save_refused, 2, str(tmp_path / "ckpt")):
        assert "threads of one process" in message and "perparam.checkpoint.save" in message, message
    assert not (tmp_path / "ckpt").exists()


def _stage2_tiny(world_size: int):
    with _SEEDED:
        torch.manual_seed(0)
        model = TinyNet()
    if world_size:
        policy = perparam.ParamPolicy(zero_stage=2)
        for block in model.blocks:
            perparam.fully_shard(block, param_policy=policy)
        perparam.fully_shard(model, param_policy=policy)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def load_then_accumulate(rank: int, world_size: int, path: str = "", models: dict | None = None) -> dict:
    """Stage 2 everywhere, SGD: a step; ``perparam.checkpoint.save``; a step; ``perparam.checkpoint.load``
    (back to after the first step); every rank loads the same full state again with ``load_state_dict``,
    rank 1 only once rank 0 has already refreshed its kept copies for its next forward; two micro-batches
    accumulated, one step. ``world_size == 0``: one process, the same arithmetic (step, two micro-batches,
    step). Returns the full parameters."""
    model, opt = _stage2_tiny(world_size)
    batches = make_batches(4, GLOBAL_BATCH)

    def micro_batch(i: int) -> None:
        x, y = batches[i]
        if world_size:
            x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        F.mse_loss(model(x), y).backward()

    micro_batch(0)
    opt.step()
    opt.zero_grad()
    if world_size:
        perparam.checkpoint.save(path, model, opt)
        micro_batch(1)
        opt.step()
        opt.zero_grad()
        models[rank] = model  # published before the collectives below
        perparam.checkpoint.load(path, model, opt)
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
        # rank 0's next forward has marked its kept copies refreshed (it waits for rank 1 there)
        if rank == 1:
            first = perparam.runtime.group.group_of(models[0]).own.kept[0]
            before = first.kept_key
            deadline = time.monotonic() + 30
            while first.kept_key == before and time.monotonic() < deadline:
                time.sleep(0.001)
        model.load_state_dict(full)
    micro_batch(2)
    # a stale generation on one rank only would refresh there: a larger all-gather than its peer's
    micro_batch(3)
    opt.step()
    return {n: (p.full_tensor() if world_size else p).detach().clone() for n, p in model.named_parameters()}


def test_a_load_on_each_thread_rank_leaves_the_peers_kept_copies_alone_and_trains_like_one_process(tmp_path):
    """2 thread ranks, stage 2: rank 1 loads after rank 0 has already refreshed its kept copies. With one load
    generation per process, rank 1's load made rank 0's fresh copies stale again: rank 0 alone refreshed at
    the next forward (debug mode: a collective mismatch). Per rank, the ranks issue the same collectives and
    match one process within 1e-5 (3 SGD steps' worth: the loaded step, then two micro-batches)."""
    want = one_process(load_then_accumulate)
    perparam.set_debug(True)
    try:
        results = run_threaded(load_then_accumulate, 2, str(tmp_path / "ckpt"), {}, timeout=60)
    finally:
        perparam.set_debug(False)
    for got in results:
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=TOL, rtol=0, msg=name)
