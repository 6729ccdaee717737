"""Communicators are created at ``fully_shard``, in one order: every process group a step uses (all-gathers,
reductions, HSDP's all-reduce, hpZ's secondary group, ``clip_grad_norm_``'s world) has had its first
collective there (``perparam.comm.process_groups.warm_up``; NCCL's is a handshake of the group's ranks),
and any two ranks that share groups created them in the same order."""

from __future__ import annotations

import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import perparam
from perparam import CommCounter
from perparam.comm.process_groups import warmed_up
from tests.distributed import run_distributed
from tests.models import local_slice, make_batches, sharded_tiny


def _first_uses(rank: int, world_size: int, shape: tuple[int, ...], hpz: bool) -> dict:
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard")[-len(shape):])
    model = sharded_tiny(n_blocks=2, mesh=mesh, reshard_after_forward=shape[-1] // 2 if hpz else None,
                         root={"mesh": mesh})
    warmed = warmed_up()
    x, y = (local_slice(t, rank, world_size) for t in make_batches(1, 8)[0])
    with CommCounter() as comm:
        for _ in range(2):
            F.mse_loss(model(x), y).backward()
            perparam.clip_grad_norm_(model.parameters(), 1.0)
    used = [r.group_name for r in comm.records if r.group_size > 1]
    return {"warmed": warmed, "used": list(dict.fromkeys(used))}


def _same_order_on_shared_groups(runs: list[dict]) -> bool:
    for a in runs:
        for b in runs:
            shared = set(a["warmed"]) & set(b["warmed"])
            if [g for g in a["warmed"] if g in shared] != [g for g in b["warmed"] if g in shared]:
                return False
    return True


def test_every_process_group_a_step_uses_was_warmed_up_at_fully_shard_in_one_order():
    for world, shape, hpz in ((3, (3,), False), (4, (2, 2), False), (4, (4,), True)):
        runs = run_distributed(_first_uses, world, shape, hpz)
        for r in runs:
            assert r["used"] and set(r["used"]) <= set(r["warmed"]), (shape, r)
            assert len(r["warmed"]) == len(set(r["warmed"]))  # each once
        assert _same_order_on_shared_groups(runs), (shape, runs)
