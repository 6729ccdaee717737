"""A sharded model and its optimizer are freed by ``del`` (and a collection): perparam holds no built model
alive (a sweep or an evaluation copy built in a loop would otherwise keep every model's shards resident).
One process launch (2 ranks) checks the variants: stages 1/2/3, ``reshard_after_forward=False``, the cpu
offload tier, the owner path with ``torch.optim.Muon`` (gradients reduce-scattered, or reduced to their
owners: ``configure(owner_grad="owner")``), ``perparam.InvariantUnits``, a distributed checkpoint saved,
bf16 mixed precision, int8 all-gather and reduce-scatter, a full state dict loaded and the gradient norm
clipped, forwards without a backward."""

from __future__ import annotations

import gc
import weakref

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh

import perparam
from perparam.full_state import load_full_state_dict
from tests.distributed import run_distributed
from tests.models import TinyNet, make_batches

VARIANTS = ["stage3", "stage1", "stage2", "no_reshard", "offload_cpu", "owner_muon", "invariant",
            "checkpoint", "bf16", "int8", "full_state_clip", "forward_only",
            "owner_grad_muon"]


def _build_and_train(variant: str, world_size: int, path: str):
    """Build TinyNet sharded per block + root for ``variant``, train 2 steps; returns weak references to the
    model, one of its parameters and the optimizer (and the units object for ``invariant``)."""
    torch.manual_seed(0)
    model, mesh, kw = TinyNet(), init_device_mesh("cpu", (world_size,)), {}
    if variant in ("stage1", "stage2"):
        kw["param_policy"] = {"*": perparam.ParamPolicy(zero_stage=int(variant[-1]))}
    elif variant == "no_reshard":
        kw["reshard_after_forward"] = False
    elif variant == "offload_cpu":
        kw["offload_policy"] = "cpu"
    elif variant in ("owner_muon", "owner_grad_muon"):
        kw["param_policy"] = {"*": perparam.ParamPolicy(update="owner")}
    elif variant == "bf16":
        kw["mp_policy"] = perparam.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                        reduce_dtype=torch.float32)
    elif variant == "int8":  # int8 all-gather and int8 gradient reduce-scatter of the Linear weights
        int8 = perparam.ParamPolicy(quant=perparam.QuantPolicy(torch.int8), grad_quant="int8")
        linear = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
        kw["param_policy"] = lambda _name, p: int8 if id(p) in linear else None
    full = {k: v.clone() for k, v in model.state_dict().items()} if variant == "full_state_clip" else None
    for block in model.blocks:
        perparam.fully_shard(block, mesh=mesh, **kw)
    perparam.fully_shard(model, mesh=mesh, **kw)
    if full is not None:
        load_full_state_dict(model, full)
    if variant in ("owner_muon", "owner_grad_muon"):  # Muon steps 2-D matrices only: the blocks' weights
        opt = torch.optim.Muon([p for p in model.blocks.parameters() if p.ndim == 2], lr=0.02)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inv = perparam.InvariantUnits(model, units=2, seed=7) if variant == "invariant" else None
    for step, (x, y) in enumerate(make_batches(2, 8)):
        if variant == "forward_only":  # an evaluation copy: forwards, the graph dropped without a backward
            torch.nn.functional.mse_loss(model(x), y)
            continue
        if inv is None:
            torch.nn.functional.mse_loss(model(x), y).backward()
        else:
            for u, (xu, yu) in inv.split((x, y)):
                with inv.unit(u, step):
                    torch.nn.functional.mse_loss(model(xu), yu).backward()
            inv.reduce()
        if full is not None:
            perparam.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
    if variant == "checkpoint":
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    refs = [weakref.ref(model), weakref.ref(next(model.parameters())), weakref.ref(opt)]
    return refs + ([weakref.ref(inv)] if inv is not None else [])


def _alive_after_del(rank: int, world_size: int, path: str) -> dict[str, list[str]]:
    """Per variant: the names of what is still alive after the owner's references are dropped and a
    collection ran (empty: all freed)."""
    out = {}
    for variant in VARIANTS:
        previous = perparam.configure(owner_grad="owner") if variant == "owner_grad_muon" else None
        try:
            refs = _build_and_train(variant, world_size, f"{path}/{variant}")
        finally:
            if previous is not None:
                perparam.configure(owner_grad=previous.owner_grad)
        gc.collect()
        out[variant] = [n for n, r in zip(["model", "parameter", "optimizer", "units"], refs)
                        if r() is not None]
    return out


def test_a_sharded_model_and_its_optimizer_are_freed_after_del(tmp_path):
    for world_size in (2,):
        for alive in run_distributed(_alive_after_del, world_size, str(tmp_path / str(world_size))):
            assert alive == {v: [] for v in VARIANTS}, (world_size, alive)
