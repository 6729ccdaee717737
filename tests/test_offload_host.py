"""The ``"cpu"`` tier's host slots (``perparam/offload/host.py``, the optimizer state of a device mesh kept in
host memory between steps), run on CPU: its ranks make ``host.tier_moves`` true, so the slots, their
evictions (device storage resized to 0 bytes), fetches, stream waits and the optimizer-state hand-over run as
on CUDA, with torch's no-op CPU streams.

What it holds: AdamW steps bitwise equal to no offload; between steps the optimizer's state entries read
their values (a logged norm of ``optimizer.state[p][key]``, and ``optimizer.state_dict()``), never a tensor
over freed storage (on CPU that read segfaults); one host wait per step for the copies back to the host; each
parameter's state read-ahead starts as its reduced gradient lands, not after the whole backward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import perparam
from perparam import OffloadPolicy
from perparam.offload import host, tier
from tests.distributed import run_distributed
from tests.models import TinyNet, local_slice, make_batches


def _norms(opt) -> dict:
    """The norm of each state tensor as a logging loop reads it: ``optimizer.state[p][key]`` directly."""
    out = {}
    for i, p in enumerate(opt.param_groups[0]["params"]):
        for key, value in opt.state[p].items():
            if key != "step":
                local = value.to_local()
                assert local.untyped_storage().nbytes() >= local.numel() * local.element_size(), (i, key)
                out[(i, key)] = torch.linalg.vector_norm(local).item()
    return out


def _host_tier_on_cpu(rank: int, world_size: int) -> dict:
    host.tier_moves = lambda device_type: True  # this rank's CPU mesh offloads as a CUDA one would
    calls = []
    real_ready = tier.ParamOffload.grad_ready

    def ready(po):  # the embedding's own?, and whether the root's gradients (reduced last) had landed yet
        root = models["host"][0]
        calls.append((po.sp.sharded is root.embed.weight, root.embed.weight.grad is not None))
        real_ready(po)

    tier.ParamOffload.grad_ready = ready
    waits = []
    real_evict = host._evict_on
    host._evict_on = lambda device, slots, write: (waits.append(len(slots)),
                                                   real_evict(device, slots, write))[1]
    torch.manual_seed(0)
    base = TinyNet(n_blocks=2)
    models = {}
    for name, offload in (("device", None), ("host", OffloadPolicy("cpu", "optimizer"))):
        model = copy.deepcopy(base)
        for block in model.blocks:
            perparam.fully_shard(block, offload_policy=offload)
        perparam.fully_shard(model, offload_policy=offload)
        models[name] = (model, torch.optim.AdamW(model.parameters(), lr=0.05))
    evicted = [s for sp in tier._OWNERS for _, s in host.slots_of(sp.offload)]
    out = {"norms": [], "slots": 0, "evicted_between_steps": []}
    for x, y in make_batches(3, 8):
        x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        for model, opt in models.values():
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        evicted = [s for sp in tier._OWNERS for _, s in host.slots_of(sp.offload)]
        out["evicted_between_steps"].append(sum(not s.resident for s in evicted))
        out["norms"].append({name: _norms(opt) for name, (_, opt) in models.items()})
    out["slots"] = len(evicted)
    want, got = (models[n][1].state_dict()["state"] for n in ("device", "host"))
    out["state_dict_equal"] = all(torch.equal(got[i][k].to_local(), v.to_local()) for i in want
                                  for k, v in want[i].items() if k != "step")
    out["params_equal"] = all(torch.equal(a.to_local(), b.to_local()) for a, b in
                              zip(models["device"][0].parameters(), models["host"][0].parameters()))
    # a step after state_dict() (which brought the state in) evicts it again
    for model, opt in models.values():
        F.mse_loss(model(x), y).backward()
        opt.step()
    out["evicted_after_state_dict_and_step"] = sum(not s.resident for s in evicted)
    out["ready_calls"] = calls
    out["evictions"] = waits
    return out


@pytest.mark.fast
def test_host_tier_state_reads_its_values_between_steps_and_steps_bitwise_like_no_offload():
    for r in run_distributed(_host_tier_on_cpu, 2):
        assert r["slots"] == 2 * 15 and r["params_equal"] and r["state_dict_equal"], r  # exp_avg, exp_avg_sq
        # between steps every host-tier state tensor's device storage is freed, and yet each state entry of
        # the optimizer reads the same norm as without offload
        assert (r["evicted_between_steps"] == [r["slots"]] * 3
                and r["evicted_after_state_dict_and_step"] == r["slots"])
        assert r["evictions"] == [r["slots"]] * 4  # every step's copies to the host waited for once, together
        for step in r["norms"]:
            assert step["host"] == step["device"], step
        # the read-ahead: once per trainable parameter per backward, each as its group's reduced gradients
        # land: the blocks' (reduced first) before the root's embedding had its gradient
        calls = r["ready_calls"]
        assert len(calls) == 4 * 15 and sum(embed for embed, _ in calls) == 4, calls
        first = [root_done for _, root_done in calls[:[embed for embed, _ in calls].index(True)]]
        assert len(first) >= 12 and not any(first), calls[:15]  # both blocks' 12 tensors came first
