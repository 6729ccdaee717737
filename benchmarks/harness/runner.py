"""What one rank runs: a configuration's steps and their records, the interleaved timing job and the
per-configuration memory job.

* Timing job: every configuration built once in one process per rank, then rounds of one step of each
  (the order rotates every round). A step (zero_grad, forward, backward, optimizer) starts after a
  barrier; per step and rank: wall time per phase, process CPU time, minor page faults, loss, bytes.
* Memory job: one configuration alone in fresh processes: ``VmRSS`` before the build (baseline), after it,
  then ``VmHWM`` reset and read after ``rss_steps`` steps (the training-phase peak), and ``VmRSS`` sampled
  through the last step.
"""

from __future__ import annotations

import os
import resource
import time
import traceback

import torch
import torch.distributed as dist
from torch import nn

import perparam
from benchmarks.harness import memory
from benchmarks.harness.comm import DistCounter
from benchmarks.harness.configs import Unsupported, build, full_state
from benchmarks.harness.model import GPTConfig, make_batches
from perparam.memory.measure import model_state_bytes


class Runner:
    """One configuration on this rank: model, optimizer, and its per-step records."""

    def __init__(self, name: str, cfg: GPTConfig, mesh, seed: int, counter: DistCounter) -> None:
        self.name = name
        self.model, self.opt = build(name, cfg, mesh, seed)
        self.counter = counter
        self.times: list[tuple[float, float, float]] = []  # forward, backward, optimizer (s)
        self.cpu: list[float] = []  # CPU seconds of this process (all threads) per step
        self.faults: list[int] = []  # minor page faults per step (fresh pages mapped by allocations)
        self.losses: list[float] = []
        self.comm: list[dict] = []  # per step: CommCounter and dist-wrapper figures
        self.error: str | None = None

    @property
    def module(self) -> nn.Module:
        return self.model.module if isinstance(self.model,
                                               nn.parallel.DistributedDataParallel) else self.model

    def step(self, x: torch.Tensor, y: torch.Tensor, record: bool,
             sampler: memory.RssSampler | None = None) -> None:
        mark = sampler.mark if sampler is not None else (lambda phase: None)
        comm = perparam.CommCounter()
        dist.barrier()
        self.counter.active = True
        with comm:
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            c0 = time.process_time()
            t0 = time.perf_counter()
            mark("forward")
            self.opt.zero_grad(set_to_none=True)
            loss = self.model(x, y)
            t1 = time.perf_counter()
            mark("backward")
            loss.backward()
            t2 = time.perf_counter()
            mark("optimizer")
            self.opt.step()
            t3 = time.perf_counter()
            mark("end")
            c1 = time.process_time()
            f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        self.counter.active = False
        calls, nbytes, sent = self.counter.take()
        if record:
            self.times.append((t1 - t0, t2 - t1, t3 - t2))
            self.cpu.append(c1 - c0)
            self.faults.append(f1 - f0)
            self.losses.append(loss.item())
            self.comm.append({"perparam_counter": {k: comm.bytes(k) for k in comm.by_kind()},
                              "perparam_counter_calls": comm.by_kind(),
                              "dist_bytes": nbytes, "dist_calls": calls,
                              "dist_sent": sent})


def model_groups(model: nn.Module) -> list:
    """The perparam ``ParamGroup``s holding parameters, each once, in ``model.modules()`` order."""
    from perparam.runtime.group import group_of

    groups = []
    for m in model.modules():
        g = group_of(m)
        if g is not None and g.params and all(g is not h for h in groups):
            groups.append(g)
    return groups


def local_batch(batch, rank: int, world: int):
    """This rank's rows of a global ``(idx, targets)`` batch."""
    x, y = batch
    n = x.shape[0] // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def _check_same_weights(runners: list[Runner], reference: dict | None) -> None:
    """Every configuration starts from the seeded full init (rank 0 compares; raises ``AssertionError``)."""
    for runner in runners:
        sd = full_state(runner.name, runner.model)
        if reference is not None:
            differ = [k for k in reference if not torch.equal(reference[k], sd[k].to(reference[k].dtype))]
            assert not differ and sd.keys() == reference.keys(), \
                f"{runner.name} does not start from the seeded full init: {differ[:5]}"
        del sd


def timing_job(rank: int, world: int, opts: dict) -> dict:
    """Every configuration interleaved: one step of each per round, rotating the order."""
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.harness.configs import seeded_full_init

    cfg = GPTConfig(**opts["model"])
    mesh = init_device_mesh("cpu", (world,))
    counter = DistCounter()
    runners, statuses = [], {}
    for name in opts["configs"]:
        try:
            runners.append(Runner(name, cfg, mesh, opts["seed"], counter))
            statuses[name] = {"status": "ok"}
        except Unsupported as e:
            statuses[name] = {"status": "unsupported", "reason": str(e)}
    _check_same_weights(runners, seeded_full_init(cfg, opts["seed"]).state_dict() if rank == 0 else None)
    batches = make_batches(cfg, 4, opts["batch_per_rank"] * world, seed=opts["seed"])
    loads = []
    for r in range(opts["warmup"] + opts["steps"]):
        batch = local_batch(batches[r % len(batches)], rank, world)
        k = r % max(len(runners), 1)
        for runner in runners[k:] + runners[:k]:
            if runner.error is None:
                try:
                    runner.step(*batch, record=r >= opts["warmup"])
                except Exception:
                    runner.error = traceback.format_exc()
        loads.append(os.getloadavg())
    out = {"configs": {name: dict(statuses[name]) for name in opts["configs"]}, "loadavg": loads}
    for runner in runners:
        rec = out["configs"][runner.name]
        if runner.error is not None:
            rec.update(status="error", reason=runner.error)
            continue
        rec.update(times=runner.times, cpu=runner.cpu, faults=runner.faults, losses=runner.losses,
                   comm=runner.comm, model_state_bytes=model_state_bytes(runner.module, runner.opt).as_dict(),
                   param_bytes_unsharded=sum(p.numel() * 4 for p in runner.module.parameters())
                   if runner.name in ("ddp", "bound") else None)
    return out


def rss_job(rank: int, world: int, opts: dict) -> dict:
    """One configuration alone: RSS before and after the build, the training-phase peak, a sampled step.
    ``opts["mmap_threshold"]``: run under a fixed glibc mmap threshold (a returning allocator)."""
    from torch.distributed.device_mesh import init_device_mesh

    if opts.get("mmap_threshold"):  # before anything large is allocated: see memory.set_mmap_threshold
        memory.set_mmap_threshold(opts["mmap_threshold"])
    cfg = GPTConfig(**opts["model"])
    mesh = init_device_mesh("cpu", (world,))
    counter = DistCounter()
    batches = make_batches(cfg, 4, opts["batch_per_rank"] * world, seed=opts["seed"])
    memory.trim()
    baseline = memory.vm_status()["VmRSS"]
    try:
        runner = Runner(opts["config"], cfg, mesh, opts["seed"], counter)
    except Unsupported as e:
        return {"status": "unsupported", "reason": str(e)}
    memory.trim()
    build_peak = memory.vm_status()["VmHWM"]
    built = memory.vm_status()["VmRSS"]
    memory.reset_peak()
    steps = max(opts["rss_steps"], 1)
    for r in range(steps - 1):
        runner.step(*local_batch(batches[r % len(batches)], rank, world), record=False)
    with memory.RssSampler() as sampler:
        runner.step(*local_batch(batches[(steps - 1) % len(batches)], rank, world), record=False,
                    sampler=sampler)
    training_peak = memory.vm_status()["VmHWM"]
    return {"status": "ok", "baseline": baseline, "built": built, "build_peak": build_peak,
            "training_peak": training_peak, "profile": sampler.summary(), **_perparam_buffers(runner.model)}


def _perparam_buffers(model: nn.Module) -> dict:
    """perparam only: bytes its pool holds idle after a step, and each group's unsharded bytes (what one
    all-gather fills; with prefetching at most two groups beyond those kept are unsharded at once)."""
    from perparam.runtime.group import group_of

    groups = list({id(g): g
                   for g in (group_of(m) for m in model.modules())
                   if g is not None and g.own.gathered}.values())
    if not groups:
        return {}
    return {"pool_idle_bytes": groups[0].ctx.pool.idle_bytes(),
            "group_unsharded_bytes": [g.own.num_shards * g.own.layout.slot_bytes for g in groups]}


JOBS = {"timing": timing_job, "rss": rss_job}
