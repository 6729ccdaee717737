"""The ``simulated`` section of ``benchmarks/gpu/check.py``: memory against the planner on rank ``--sim-rank``
of a fake ``--sim-world``-rank mesh (torch's fake process group: collectives move no data, allocations are
real)."""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

from benchmarks.gpu.sections import model_config, shard_perparam
from benchmarks.harness.configs import seeded_full_init
from benchmarks.harness.model import GPT, GPTConfig, make_batches


def _bf16_policy():
    import perparam

    return perparam.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def simulated_memory(cfg: GPTConfig, world: int, rank: int, device: str, steps: int = 2,
                     batch: int = 2) -> dict:
    """Rank ``rank`` of a fake ``world``-rank mesh: model-state bytes measured vs predicted, and (CUDA)
    the peak allocated bytes of the last step. Bytes. Leaves no process group behind."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from perparam.full_state import load_full_state_dict
    from perparam.memory.measure import model_state_bytes
    from perparam.memory.plan import plan_module

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        mesh = init_device_mesh(device, (world,))
        with torch.device("meta"):
            model = GPT(cfg)
        predicted = plan_module(model, world, dtype=None, grad_bytes=None, optim_bytes=8,
                                mp_policy=_bf16_policy()).rank(rank)
        groups = shard_perparam(model, mesh, _bf16_policy())
        if rank == 0:
            load_full_state_dict(model, seeded_full_init(cfg, 0).state_dict())
        else:  # the fake group's broadcasts deliver nothing: uninitialised shards (values do not matter here)
            model.to_empty(device=device)
            with torch.no_grad():
                for p in model.parameters():
                    p.to_local().normal_(0, 0.02)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = (t.to(device) for t in make_batches(cfg, 1, batch)[0])
        for step in range(steps):
            if device == "cuda" and step == steps - 1:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            opt.zero_grad(set_to_none=True)
            model(x, y).backward()
            opt.step()
        measured = model_state_bytes(model, opt)
        unsharded = [g.own.num_shards * g.own.layout.slot_bytes for g in groups if g is not None and g.params]
        out = {"world": world, "rank": rank, "device": device,
               "model_state_bytes_measured": measured.as_dict(),
               "model_state_bytes_predicted": {"params": int(predicted.params), "grads": int(predicted.grads),
                                               "optimizer": int(predicted.optimizer),
                                               "total": int(predicted.total)},
               # AdamW keeps one scalar step counter per parameter tensor (not in the layout's figure)
               "adamw_step_counter_bytes": sum(s["step"].numel() * s["step"].element_size()
                                               for s in opt.state.values() if torch.is_tensor(s.get("step"))),
               # one fp32 used flag per trainable parameter tensor: the sharded gradients are views of the
               # reduce-scatter output, which ends with them (perparam.runtime.group.ParamGroup.reduce_grads)
               "used_flag_bytes": 4 * sum(len(g.trainable()) for g in groups if g is not None and g.params),
               "unsharded_group_bytes": unsharded,
               "two_adjacent_groups_unsharded_bytes": max((a + b for a, b in zip(unsharded, unsharded[1:])),
                                                          default=sum(unsharded))}
        if device == "cuda":
            torch.cuda.synchronize()
            out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
            out["transient_bytes"] = out["peak_allocated_bytes"] - measured.total
        del model, opt
        return out
    finally:
        gc.collect()
        dist.destroy_process_group()


def simulated(out: dict, args) -> None:
    """Memory against the planner: rank ``--sim-rank`` of a fake ``--sim-world``-rank mesh (bytes)."""
    sim = simulated_memory(model_config(args), args.sim_world, args.sim_rank, args.device, args.sim_steps)
    out.update(sim)
    meas, pred = sim["model_state_bytes_measured"], sim["model_state_bytes_predicted"]
    out["params_match_plan"] = meas["params"] == pred["params"]
    out["grads_match_plan"] = meas["grads"] == pred["grads"] + sim["used_flag_bytes"]
    out["optimizer_matches_plan"] = meas["optimizer"] == pred["optimizer"] + sim["adamw_step_counter_bytes"]
