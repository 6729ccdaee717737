"""The meta-device start of torchtitan and accelerate: a model built on ``meta``, sharded, then rank 0's full
state dict distributed (``distribute_tensor`` into the sharded parameters' placements, or torch's
``set_model_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)``) and loaded with
``load_state_dict(sd, assign=True)``: the values become the shards of perparam's own parameter objects, so an
optimizer built before the load steps the live parameters, and training matches one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

import perparam
from perparam.checkpoint import CheckpointError
from tests.distributed import one_process, run_distributed
from tests.models import TinyNet, full_params, make_batches, train_steps


def _rank0_full_state() -> dict[str, torch.Tensor]:
    """The pretrained weights as rank 0 holds them (the other ranks hold zeros of the same shapes)."""
    torch.manual_seed(0)
    full = TinyNet().state_dict()
    if dist.is_initialized() and dist.get_rank() != 0:
        full = {k: torch.zeros_like(v) for k, v in full.items()}
    return full


def meta_start(rank: int, world_size: int, how: str) -> dict:
    full = _rank0_full_state()
    if not world_size:  # the reference: one process loads the weights
        model = TinyNet()
        model.load_state_dict(full)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = train_steps(model, opt, make_batches(3, 12), rank, world_size)
        return {"params": full_params(model), "losses": losses}
    with torch.device("cpu" if "real" in how else "meta"):  # real: shards materialised, taken by a copy
        model = TinyNet()
    policy = {"*": perparam.ParamPolicy(zero_stage=2)} if "stage2" in how else None  # kept copies
    for block in model.blocks:
        perparam.fully_shard(block, param_policy=policy)
    perparam.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built on the meta parameters, before the load
    before = [id(p) for p in model.parameters()]
    if how == "set_model_state_dict":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, full if rank == 0 else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    else:
        current = model.state_dict()
        sd = {k: distribute_tensor(full[k], v.device_mesh, v.placements) if how.startswith("dtensor") else
              full[k] for k, v in current.items()}
        if how == "plain":  # every rank holds the full weights (FSDP2 fails on these at the first forward)
            torch.manual_seed(0)
            sd = TinyNet().state_dict()
        model.load_state_dict(sd, assign=True)
    kept = [id(p) for p in model.parameters()] == before and all(
        p is q for p, q in zip(model.parameters(), opt.param_groups[0]["params"]))
    on_meta = [n for n, p in model.named_parameters() if p.is_meta]
    losses = train_steps(model, opt, make_batches(3, 12), rank, world_size)
    return {"params": full_params(model), "losses": losses, "kept": kept, "on_meta": on_meta,
            "sharded": all(isinstance(p, DTensor) for p in model.parameters())}


@pytest.mark.parametrize("how,world_size", [
    pytest.param("dtensor", 4, marks=pytest.mark.fast), ("dtensor", 1), ("plain", 3),
    ("set_model_state_dict", 2), ("dtensor-stage2", 3), ("dtensor-real", 2)])
def test_a_meta_model_loaded_with_assign_keeps_its_parameters_and_trains_like_one_process(how, world_size):
    want = one_process(meta_start, how)
    for got in run_distributed(meta_start, world_size, how):
        assert got["kept"] and got["sharded"] and got["on_meta"] == []
        for name, value in want["params"].items():
            torch.testing.assert_close(got["params"][name], value, rtol=0, atol=1e-5, msg=name)


def refused(rank: int, world_size: int) -> dict:
    full = _rank0_full_state()
    with torch.device("meta"):
        model = TinyNet()
    perparam.fully_shard(model)
    current = model.state_dict()
    sd = {k: distribute_tensor(full[k], v.device_mesh, v.placements) for k, v in current.items()}
    sd["head.weight"] = distribute_tensor(full["head.weight"], current["head.weight"].device_mesh,
                                          [Replicate()])
    errors = []
    try:
        model.load_state_dict(sd, assign=True)
    except CheckpointError as e:
        errors.append(str(e))
    model.to_empty(device="cpu")
    model.unshard()  # the gathered copies are registered: assigning would replace them, not the shards
    try:
        model.load_state_dict(model.state_dict(), assign=True)
    except CheckpointError as e:
        errors.append(str(e))
    return {"errors": errors}


def test_an_assigned_dtensor_of_other_placements_or_over_unsharded_parameters_is_refused_naming_it():
    for got in run_distributed(refused, 2):
        placements, unsharded = got["errors"]
        assert "'head.weight'" in placements and "Replicate()" in placements, placements
        assert "distribute_tensor(full, param.device_mesh, param.placements)" in placements, placements
        assert ("'embed.weight'" in unsharded
                and "reshard() on the sharded module first" in unsharded), unsharded
