"""A prepared check of perparam on one CUDA GPU (under 5 minutes): memory of a simulated 8-rank mesh against
the layout's prediction, and step time of perparam vs torch FSDP2 in bf16 over NCCL with world size 1.

    python benchmarks/gpu_check.py --json runs/bench/gpu_check.json [--sim-world 8] [--steps 20]

1. Simulated mesh (torch's fake process group: one process plays rank ``--sim-rank`` of ``--sim-world``;
   collectives move no data, allocations are real). The benchmark model (``benchmarks/model.py``) is built
   on the meta device, wrapped as ``benchmarks/configs.py`` wraps it, bf16 compute
   (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), materialised by
   ``load_full_state_dict`` (rank 0; another rank: ``to_empty()``), trained ``--sim-steps`` AdamW steps. Reported: model-state bytes measured
   (``perparam.memory.measure``) vs predicted (``perparam.memory.plan.plan_module``: fp32 shards, fp32
   gradients, 8 bytes of AdamW state per element); the bytes of the two largest adjacent groups unsharded
   in bf16 (current + prefetched, from each group's ``GroupLayout``); on CUDA the peak allocated bytes of
   the last step (``torch.cuda.max_memory_allocated``) and the transient part (peak - model state).
   Runs on CPU too (``--device cpu``), which is what the test suite exercises without a GPU.
2. NCCL, world size 1, CUDA: perparam and FSDP2, bf16, the same model and weights; median step time over
   ``--steps`` interleaved steps (``torch.cuda.synchronize`` around each). The CUDA streams the kernels
   of one step ran on are listed (torch.profiler): NCCL kernels on a stream of their own show
   communication overlapping compute. At world size 1 perparam issues no collective (a copy), so that
   column shows FSDP2's streams only; on a multi-GPU machine run with ``torchrun`` for the stream check.
3. The ``"cpu"`` offload tier (``docs/offload.md``), NCCL, world size 1, CUDA: the same perparam model with
   its AdamW state in pinned host memory (``OffloadPolicy("cpu", "optimizer")``) against no offload,
   interleaved steps. Reported: median step times and their ratio, CUDA memory allocated between steps
   (falls by the state's bytes), the parameters after the steps (bitwise equal: the copies are exact),
   and per step the seconds the host waited for the host-to-device copies started at each gradient's
   reduction (the part backward did not hide) and spent copying the state back after the step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.configs import seeded_full_init, wrap_units  # noqa: E402
from benchmarks.model import GPT, GPTConfig, make_batches  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; a bad value exits with a one-line error naming the flag."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--sim-world", type=int, default=8, help="ranks of the simulated mesh (default 8)")
    ap.add_argument("--sim-rank", type=int, default=0, help="the simulated rank measured (default 0: the most bytes)")
    ap.add_argument("--sim-steps", type=int, default=2, help="training steps on the simulated mesh (default 2)")
    ap.add_argument("--steps", type=int, default=20, help="timed NCCL steps per configuration (default 20)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed NCCL steps first (default 3)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda (default); cpu runs only the simulated-mesh memory check")
    ap.add_argument("--quick", action="store_true", help="the toy model (GPTConfig.quick())")
    args = ap.parse_args(argv)
    for flag in ("sim_world", "sim_steps", "steps", "batch"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1 (got {getattr(args, flag)})")
    if not 0 <= args.sim_rank < args.sim_world:
        ap.error(f"--sim-rank must be in [0, --sim-world) = [0, {args.sim_world}) (got {args.sim_rank})")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here; use --device cpu for the simulated-mesh memory check")
    return args


def _bf16_policy():
    import perparam

    return perparam.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _shard_perparam(model: GPT, mesh) -> list:
    import perparam
    from perparam.runtime.group import group_of

    groups = []
    for modules, raf in wrap_units(model):
        target = modules if len(modules) > 1 else modules[0]
        perparam.fully_shard(target, mesh=mesh, reshard_after_forward=raf, mp_policy=_bf16_policy())
        groups.append(group_of(modules[0]))
    return groups


def simulated_memory(cfg: GPTConfig, world: int, rank: int, device: str, steps: int = 2, batch: int = 2) -> dict:
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
        groups = _shard_perparam(model, mesh)
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
        unsharded = [g.num_shards * g.layout.slot_bytes for g in groups if g is not None and g.params]
        out = {"world": world, "rank": rank, "device": device,
               "model_state_bytes_measured": measured.as_dict(),
               "model_state_bytes_predicted": {"params": int(predicted.params), "grads": int(predicted.grads),
                                               "optimizer": int(predicted.optimizer), "total": int(predicted.total)},
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
        import gc

        gc.collect()
        dist.destroy_process_group()


def _streams_of_one_step(step) -> dict:
    """CUDA streams the kernels of ``step()`` ran on: {stream id: {"nccl": n, "compute": n}}."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    streams: dict = {}
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        sid = str(getattr(e, "stream", None) or getattr(getattr(e, "kineto_info", None), "stream", "?"))
        kind = "nccl" if "nccl" in e.name.lower() else "compute"
        streams.setdefault(sid, {"nccl": 0, "compute": 0})[kind] += 1
    return streams


@contextlib.contextmanager
def nccl_world_of_one(port: str):
    """A 1-rank NCCL process group on GPU 0 (``MASTER_PORT`` ``port`` unless set); yields its 1D mesh and
    destroys the group (after ``gc.collect()``) on the way out."""
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", port)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        torch.cuda.set_device(0)
        yield init_device_mesh("cuda", (1,))
    finally:
        import gc

        gc.collect()
        dist.destroy_process_group()


def interleaved_steps(runs: dict, warmup: int, steps: int, after_step=None, after_warmup=None) -> None:
    """``warmup + steps`` rounds of each run's ``step()``, the order reversed every other round (pairing);
    appends the seconds of each step after the warm-up to ``run["times"]`` (synchronised: device time).
    ``after_step(run)`` runs after every step, ``after_warmup()`` once the warm-up rounds are done."""
    for r in range(warmup + steps):
        for run in (list(runs.values()) if r % 2 == 0 else list(runs.values())[::-1]):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run["step"]()
            torch.cuda.synchronize()
            if r >= warmup:
                run["times"].append(time.perf_counter() - t0)
            if after_step is not None:
                after_step(run)
        if r == warmup - 1 and after_warmup is not None:
            after_warmup()


def nccl_step_times(cfg: GPTConfig, steps: int, warmup: int, batch: int) -> dict:
    """perparam vs FSDP2 over NCCL, world size 1, bf16, interleaved steps: median seconds and streams."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from perparam.full_state import load_full_state_dict

    with nccl_world_of_one("29533") as mesh:
        full = seeded_full_init(cfg, 0).state_dict()
        runs = {}
        with torch.device("meta"):
            pp = GPT(cfg)
        _shard_perparam(pp, mesh)
        load_full_state_dict(pp, full)
        with torch.device("meta"):
            f2 = GPT(cfg)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for modules, raf in wrap_units(f2):
            fully_shard(modules if len(modules) > 1 else modules[0], mesh=mesh, reshard_after_forward=raf, mp_policy=mp)
        f2.to_empty(device="cuda")
        set_model_state_dict(f2, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        x, y = (t.cuda() for t in make_batches(cfg, 1, batch)[0])
        for name, model in (("perparam_bf16", pp), ("fsdp2_bf16", f2)):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

            def step(model=model, opt=opt):
                opt.zero_grad(set_to_none=True)
                loss = model(x, y)
                loss.backward()
                opt.step()
                return loss

            runs[name] = {"step": step, "times": []}
        interleaved_steps(runs, warmup, steps)
        out = {name: {"step_time_s": statistics.median(run["times"]), "streams": _streams_of_one_step(run["step"]),
                      "final_loss": float(run["step"]())} for name, run in runs.items()}
        out["ratio_perparam_vs_fsdp2"] = out["perparam_bf16"]["step_time_s"] / out["fsdp2_bf16"]["step_time_s"]
        return out


def cpu_tier_offload(cfg: GPTConfig, steps: int, warmup: int, batch: int) -> dict:
    """perparam with AdamW state in pinned host memory vs on the GPU, NCCL, world size 1 (section 3)."""
    import perparam
    from perparam import OffloadPolicy
    from perparam.full_state import load_full_state_dict

    with nccl_world_of_one("29534") as mesh:
        full = seeded_full_init(cfg, 0).state_dict()
        x, y = (t.cuda() for t in make_batches(cfg, 1, batch)[0])
        runs = {}
        for name, offload in (("device", None), ("cpu_optimizer", OffloadPolicy("cpu", "optimizer"))):
            with torch.device("meta"):
                model = GPT(cfg)
            for modules, raf in wrap_units(model):
                perparam.fully_shard(modules if len(modules) > 1 else modules[0], mesh=mesh, reshard_after_forward=raf,
                                     mp_policy=_bf16_policy(), offload_policy=offload)
            load_full_state_dict(model, full)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

            def step(model=model, opt=opt):
                opt.zero_grad(set_to_none=True)
                model(x, y).backward()
                opt.step()

            runs[name] = {"model": model, "step": step, "times": [], "allocated": 0}
        perparam.offload.reset_stats()

        def after(run):
            run["allocated"] = torch.cuda.memory_allocated()

        interleaved_steps(runs, warmup, steps, after_step=after, after_warmup=perparam.offload.reset_stats)
        io = perparam.offload.stats()
        params = {name: {n: p.full_tensor() for n, p in run["model"].named_parameters()} for name, run in runs.items()}
        out = {name: {"step_time_s": statistics.median(run["times"]), "allocated_bytes_between_steps": run["allocated"]}
               for name, run in runs.items()}
        out["ratio_cpu_vs_device"] = out["cpu_optimizer"]["step_time_s"] / out["device"]["step_time_s"]
        out["offloaded_bytes"] = perparam.offload.offloaded_bytes().get("cpu", 0)
        out["allocated_fall_bytes"] = (out["device"]["allocated_bytes_between_steps"]
                                       - out["cpu_optimizer"]["allocated_bytes_between_steps"])
        out["params_bitwise_equal"] = all(torch.equal(params["device"][n], t) for n, t in params["cpu_optimizer"].items())
        out["copy_wait_s_per_step"] = io["wait_s"] / steps
        out["copy_back_s_per_step"] = io["evict_s"] / steps
        return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cfg = GPTConfig.quick() if args.quick else GPTConfig()
    t0 = time.perf_counter()
    result = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "model": cfg.as_dict(),
              "simulated": simulated_memory(cfg, args.sim_world, args.sim_rank, args.device, args.sim_steps)}
    if args.device == "cuda":
        result["nccl_world_1"] = nccl_step_times(cfg, args.steps, args.warmup, args.batch)
        result["cpu_tier"] = cpu_tier_offload(cfg, args.steps, args.warmup, args.batch)
    result["wall_s"] = time.perf_counter() - t0
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    _render(result)
    return result


def _render(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    mib = 1 << 20
    sim = result["simulated"]
    table = Table(title=f"rank {sim['rank']} of a simulated {sim['world']}-rank mesh ({sim['device']}), bf16 compute")
    table.add_column("figure")
    table.add_column("MiB", justify="right")
    meas, pred = sim["model_state_bytes_measured"], sim["model_state_bytes_predicted"]
    for key in ("params", "grads", "optimizer", "total"):
        table.add_row(f"model state {key}: measured / predicted", f"{meas[key] / mib:.2f} / {pred[key] / mib:.2f}")
    table.add_row("two adjacent groups unsharded (bf16)", f"{sim['two_adjacent_groups_unsharded_bytes'] / mib:.2f}")
    if "peak_allocated_bytes" in sim:
        table.add_row("peak allocated in a step / transient (peak - state)",
                      f"{sim['peak_allocated_bytes'] / mib:.1f} / {sim['transient_bytes'] / mib:.1f}")
    if "nccl_world_1" in result:
        n = result["nccl_world_1"]
        for name in ("perparam_bf16", "fsdp2_bf16"):
            table.add_row(f"{name} step ms (NCCL, world 1)", f"{n[name]['step_time_s'] * 1e3:.2f}")
        table.add_row("perparam / FSDP2 step time", f"{n['ratio_perparam_vs_fsdp2']:.2f}")
    if "cpu_tier" in result:
        c = result["cpu_tier"]
        table.add_row("cpu tier (AdamW state pinned on host) / device step time", f"{c['ratio_cpu_vs_device']:.2f}")
        table.add_row("cpu tier: CUDA allocated fall / state offloaded",
                      f"{c['allocated_fall_bytes'] / mib:.1f} / {c['offloaded_bytes'] / mib:.1f}")
        table.add_row("cpu tier: ms per step waiting for H2D / copying back",
                      f"{c['copy_wait_s_per_step'] * 1e3:.2f} / {c['copy_back_s_per_step'] * 1e3:.2f}")
        table.add_row("cpu tier: parameters bitwise equal to device", str(c["params_bitwise_equal"]))
    Console().print(table)
    if "nccl_world_1" in result:
        for name in ("perparam_bf16", "fsdp2_bf16"):
            print(f"{name} CUDA streams (kernels per stream): {result['nccl_world_1'][name]['streams']}")
    print(f"gpu_check took {result['wall_s']:.1f} s")


if __name__ == "__main__":
    main()
