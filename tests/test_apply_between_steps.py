"""``.to()`` / ``to_empty()`` between steps on a sharded tree (``nn.Module._apply``): the next forward
computes with the shards as they are after it, never with an unsharded copy kept from before (stage-1/2 kept
copies, ``perparam.runtime.zero``), whether it is called on the root, on a sharded submodule or on a plain
submodule of a sharded tree."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import perparam
from perparam import ParamPolicy
from tests.distributed import one_process, run_distributed

TOL = 1e-5


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _reinitialise(module: nn.Module) -> None:
    """What a user does to re-initialise a part of a model: storage anew, then an init under ``no_grad``."""
    module.to_empty(device="cpu")
    with torch.no_grad():
        for p in module.parameters():
            nn.init.constant_(p, 0.1)


def train(rank: int, world_size: int, stage: int, where: int) -> dict:
    """SGD steps of ``Linear(3, 5) -> ReLU -> Linear(5, 2)`` (5 rows: uneven on 2 ranks), the root sharded
    under ``stage``; after the first step a ``no_grad`` forward (it fills the kept copies) and then
    ``_reinitialise(model[where])``: a plain submodule of the sharded root. ``world_size == 0``: one
    process, the whole batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
    if world_size:
        perparam.fully_shard(model, param_policy=ParamPolicy(zero_stage=stage))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    n = 6 // max(world_size, 1)
    rows = slice(rank * n, (rank + 1) * n) if world_size else slice(None)
    for step in range(3):
        x, y = torch.randn(6, 3, generator=g)[rows], torch.randn(6, 2, generator=g)[rows]
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if step == 0:
            with torch.no_grad():
                model(x)
            _reinitialise(model[where])
    with torch.no_grad():
        after = model(torch.randn(6, 3, generator=g)[rows])
    return {"params": {name: _full(p) for name, p in model.named_parameters()}, "after": after}


def train_cases(rank: int, world_size: int, cases: list) -> list[dict]:
    return [train(rank, world_size, *case) for case in cases]


@pytest.mark.fast
def test_to_empty_on_a_plain_submodule_refreshes_kept_copies_of_stages_1_and_2():
    cases = [(1, 0), (2, 2), (3, 0)]
    want = {case: one_process(train, *case) for case in cases}
    for rank, per_case in enumerate(run_distributed(train_cases, 2, cases)):
        for case, got in zip(cases, per_case):
            for name, p in want[case]["params"].items():
                torch.testing.assert_close(got["params"][name], p, atol=TOL, rtol=0,
                                           msg=f"(stage, submodule) {case} rank {rank}: {name}")
            torch.testing.assert_close(got["after"], want[case]["after"][rank * 3:(rank + 1) * 3], atol=TOL,
                                       rtol=0, msg=f"(stage, submodule) {case} rank {rank}: forward")


def dcp_load_in_place(rank: int, world_size: int, path: str, kept: str, how: str) -> dict:
    """Unsharded storage kept across an in-place write (``kept``: ``"stages"``, stage 1 and 2 in one group;
    ``"stage3"``, stage 3 with ``reshard_after_forward=False``): a step, ``dcp.save`` of
    ``model.state_dict()``, a step, an eval forward (it fills the kept storage), then ``how``:
    ``"dcp"``, ``dcp.load(model.state_dict())`` (in place, without ``model.load_state_dict``); ``"held"``,
    ``dcp.load`` into the state dict taken before the first step; ``"direct"``, the saved weights copied
    into the sharded parameters under ``no_grad``. What the next forward raises, and its output after the
    fix the message names."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
    if kept == "stages":
        perparam.fully_shard(model,
                             param_policy={"0.*": ParamPolicy(zero_stage=1),
                                           "2.*": ParamPolicy(zero_stage=2)})
    else:
        perparam.fully_shard(model, reshard_after_forward=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    held = model.state_dict()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 3, generator=g)[rank * 3:(rank + 1) * 3]
    for step in range(2):
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        if step == 0:
            saved = {name: _full(p) for name, p in model.named_parameters()}
            dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    with torch.no_grad():
        model(x)
        if how == "dcp":
            dcp.load({"model": model.state_dict()}, checkpoint_id=path)
        elif how == "held":
            dcp.load({"model": held}, checkpoint_id=path)
        else:
            for name, p in model.named_parameters():  # Shard(0): torch.chunk's rows, none empty on 2 ranks
                p.to_local().copy_(saved[name].chunk(world_size)[rank])
        try:
            model(x)
            error = "no error"
        except perparam.UnseenShardWriteError as e:
            error = str(e)
        model.mark_shards_written()  # the public fix the error names, on every rank
        return {"error": error, "after": model(x), "saved": saved, "x": x}


CASES = [("stages", "dcp"), ("stage3", "dcp"), ("stages", "held"), ("stage3", "held"), ("stages", "direct")]


def dcp_loads_in_place(rank: int, world_size: int, path: str) -> dict:
    return {case: dcp_load_in_place(rank, world_size, f"{path}-{'-'.join(case)}", *case) for case in CASES}


@pytest.mark.fast
def test_dcp_load_in_place_without_load_state_dict_is_refused_until_the_kept_storage_is_refreshed(tmp_path):
    fix = {"stages": ("ZeRO stage 1", "model.mark_shards_written()"),
           "stage3": ("reshard_after_forward=False", "model.mark_shards_written()")}
    for rank, per_kept in enumerate(run_distributed(dcp_loads_in_place, 2, str(tmp_path / "ckpt"))):
        for (kept, how), got in per_kept.items():
            for fragment in ("'0.weight'", "dcp.load(model.state_dict())", "set_model_state_dict",
                             *fix[kept]):
                assert fragment in got["error"], (kept, how, rank, got["error"])
            torch.manual_seed(0)
            reference = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
            reference.load_state_dict(got["saved"])
            torch.testing.assert_close(got["after"], reference(got["x"]).detach(), atol=TOL, rtol=0,
                                       msg=f"{kept} {how} rank {rank}")
