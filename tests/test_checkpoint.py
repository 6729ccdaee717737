"""Distributed checkpoints (torch.distributed.checkpoint) save on one world size or mesh shape and load on
another: parameters and AdamW state reassemble exactly, and training continues as if uninterrupted."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tests.distributed import run_distributed
from tests.models import local_slice, make_batches, sharded_tiny

STEPS_BEFORE, STEPS_AFTER, GLOBAL_BATCH = 3, 2, 12


def _build(world_size: int, hsdp: bool):
    mesh = (init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp_replicate", "dp_shard")) if hsdp
            else init_device_mesh("cpu", (world_size,)))
    model = sharded_tiny(mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _steps(model, opt, batches, rank, world_size) -> list[float]:
    losses = []
    for x, y in batches:
        loss = F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        losses.append(loss.item() / world_size)
    return losses


def _full(state: dict) -> dict:
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in _full(v).items()})
        elif isinstance(v, DTensor):
            out[k] = v.full_tensor()
        elif isinstance(v, torch.Tensor):
            out[k] = v.clone()
    return out


def save(rank: int, world_size: int, path: str) -> dict:
    model, opt = _build(world_size, hsdp=False)
    _steps(model, opt, make_batches(STEPS_BEFORE, GLOBAL_BATCH), rank, world_size)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return _full({"model": model_sd, "optim": optim_sd})


def load_and_continue(rank: int, world_size: int, path: str, hsdp: bool) -> tuple[dict, list[float]]:
    model, opt = _build(world_size, hsdp)
    model_sd, optim_sd = get_state_dict(model, opt)  # the templates: this world's sharding
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    model_sd, optim_sd = get_state_dict(model, opt)
    loaded = _full({"model": model_sd, "optim": optim_sd})
    losses = _steps(model, opt, make_batches(STEPS_BEFORE + STEPS_AFTER, GLOBAL_BATCH)[STEPS_BEFORE:], rank,
                    world_size)
    return loaded, losses


def uninterrupted(rank: int, world_size: int) -> list[float]:
    model, opt = _build(world_size, hsdp=False)
    return _steps(model, opt, make_batches(STEPS_BEFORE + STEPS_AFTER, GLOBAL_BATCH), rank, world_size)


def test_checkpoint_saved_on_2_ranks_loads_on_3_ranks_and_on_a_2x2_hsdp_mesh(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_distributed(save, 2, path)[0]
    want_losses = run_distributed(uninterrupted, 2)[0][STEPS_BEFORE:]
    for world_size, hsdp in ((3, False), (4, True)):
        loaded, losses = run_distributed(load_and_continue, world_size, path, hsdp)[0]
        assert loaded.keys() == saved.keys()
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), key
        assert max(abs(a - b) for a, b in zip(losses, want_losses)) <= 1e-5, (losses, want_losses)
