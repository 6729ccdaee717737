"""No host sync on the hot path: a training step's forward and backward read nothing back from the device
and upload no host data, and the rest of the step (``clip_grad_norm_`` whose norm is not read, AdamW's step,
``zero_grad``) reads one value back, ``clip_grad_norm_``'s agreement that no rank refused a gradient
(``benchmarks/harness/host_syncs.py`` counts the calls that would block the host on CUDA: ``.item()``,
``bool(t)``, ``.tolist()``, ``.cpu()``, ``torch.tensor(data, device=...)``, ...), whatever the reduction path:
gloo's zero-copy and packed reduce-scatters, replicated parameters' all-reduce, HSDP, int8 gradient
reduce-scatter, int8 all-gathers (their scales), NF4 stored weights; world sizes with empty shards. The used
flags are device constants (``perparam.runtime.reduction.used_flags``); their sums are read back only on a
rank that lacked a gradient a peer may have had (a rank-dependent branch)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate

import perparam
from benchmarks.harness.host_syncs import HostSyncCounter
from perparam import ParamPolicy, QuantPolicy
from tests.distributed import run_distributed
from tests.models import local_slice, make_batches, sharded_tiny


def _policy(case: str):
    if case == "replicated":
        return {"*norm*": ParamPolicy(placement=Replicate())}
    if case == "int8_grads":
        return {"*fc*": ParamPolicy(grad_quant="int8")}
    if case == "int8_gather":
        return {"*fc*": ParamPolicy(quant=QuantPolicy("int8"))}
    if case == "nf4":
        return {"*fc1.weight": ParamPolicy(requires_grad=False,
                                           quant=QuantPolicy("nf4", store_quantized=True))}
    return None


def _steps(rank: int, world_size: int, case: str) -> dict:
    if case == "packed":
        perparam.configure(gloo_reduce_scatter="native", gloo_all_gather="native")
    shape = (2, world_size // 2) if case == "hsdp" else (world_size,)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard")[-len(shape):])
    model = sharded_tiny(n_blocks=2, mesh=mesh, param_policy=_policy(case), root={"mesh": mesh})
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    x, y = (local_slice(t, rank, world_size) for t in make_batches(1, 12)[0])
    counts, rest = [], []
    for _ in range(3):
        with HostSyncCounter() as syncs:
            F.mse_loss(model(x), y).backward()
        counts.append(dict(syncs.sites))
        with HostSyncCounter() as syncs:  # the rest of the step: the norm is not read (a log would read it)
            perparam.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        rest.append({site: n for site, n in syncs.sites.items() if site.startswith("perparam/")})
    return {"counts": counts, "rest": rest}


def test_a_step_reads_back_only_the_clip_agreement_and_uploads_nothing_on_every_reduction_path():
    for world, cases in ((2, ("default", "packed", "replicated", "int8_grads", "int8_gather", "nf4")),
                         (3, ("default", "packed")), (4, ("hsdp",))):
        for case in cases:
            for r in run_distributed(_steps, world, case):
                # the first step uploads each distinct flag pattern once, then they are device constants
                assert all("reduction.py" in site and "upload" in site
                           for site in r["counts"][0]), r["counts"]
                assert r["counts"][1:] == [{}, {}], (world, case, r["counts"])
                # clip_grad_norm_ + AdamW's step + zero_grad: perparam reads one value back, clip_grad_norm_'s
                # agreement that no rank refused a gradient (the mesh tensors are read once per mesh, at the
                # first clip); AdamW's own reads are of its host step counters, no device sync
                for rest in r["rest"][1:]:
                    [(site, n)] = rest.items()
                    assert site.startswith("perparam/clip.py:") and site.endswith(" bool") and n == 1, rest


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.branch = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, use_branch: bool):
        h = self.trunk(x)
        return (h + self.branch(h) * (1.0 if use_branch else 0.0) if use_branch
                else h + 0 * self.branch(h).detach())


def _rank_dependent(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = _Branchy()
    perparam.fully_shard(model.branch)
    perparam.fully_shard(model)
    model(torch.ones(2, 4), use_branch=rank == 0).sum().backward()  # the flag patterns uploaded once
    with HostSyncCounter() as syncs:
        model(torch.ones(2, 4), use_branch=rank == 0).sum().backward()
    return {"sites": dict(syncs.sites), "branch_grad": model.branch.weight.grad is not None}


@pytest.mark.fast
def test_only_a_rank_that_lacked_a_gradient_reads_the_summed_flags_back():
    r0, r1 = run_distributed(_rank_dependent, 2)
    assert r0["sites"] == {} and r0["branch_grad"]
    # rank 1 had no gradient for the branch: one read of the branch group's summed flags, which say rank 0 had
    assert list(r1["sites"].values()) == [1] and "tolist" in next(iter(r1["sites"])) and r1["branch_grad"]


def _invariant_step(rank: int, world_size: int) -> list[dict]:
    mesh = init_device_mesh("cpu", (world_size,))
    model = sharded_tiny(n_blocks=2, mesh=mesh)
    iu = perparam.InvariantUnits(model, units=4, seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    counts = []
    for step, (x, y) in enumerate(make_batches(2, 8)):
        losses = []
        for u, (xu, yu) in iu.split((x, y)):
            with iu.unit(u, step):
                loss = F.mse_loss(model(xu), yu)
                loss.backward()
            losses.append(loss.detach())
        iu.reduce()
        with HostSyncCounter() as syncs:  # what the step does after its units, with nothing read for a log
            iu.clip_grad_norm_(1.0)
            iu.mean(losses)
        counts.append({site: n for site, n in syncs.sites.items() if site.startswith("perparam/")})
        opt.step()
        opt.zero_grad()
    return counts


@pytest.mark.fast
def test_the_invariant_clip_and_mean_read_nothing_back():
    """``InvariantUnits.clip_grad_norm_`` and ``InvariantUnits.mean`` keep their results on the device: no
    ``.item()``/``float(t)``/``bool(t)`` of a device value (each a host sync on CUDA); the caller's own read
    for a log is its choice."""
    for world in (1, 2):
        for counts in run_distributed(_invariant_step, world):
            assert counts == [{}, {}], (world, counts)
