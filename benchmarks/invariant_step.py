"""What the K-invariant mode costs (``perparam.InvariantUnits``): step time, the step's peak resident memory
and the gradient buffers it holds, against the normal mode at the same global batch, in paired rounds.

    python -m benchmarks.invariant_step --json runs/bench/invariant_step.json    # the 27.4M GPT, K = 2
    python -m benchmarks.invariant_step --quick --json /tmp/invariant.json       # the toy model (smoke test)

Variants, one model each (``benchmarks.harness.configs.build("perparam", ...)``: the seeded init, stage 3,
AdamW), the same global batches of ``--batch`` sequences (default 8) on ``--world`` ranks (default 2):

* ``plain``: one backward per rank on its ``batch / K`` rows (the usual synchronised step);
* ``accum_uU``: the same rows as ``U / K`` micro-batches, gradient sync off for all but the last (the
  normal accumulation, loss divided by ``U / K``): the same backwards as the mode, so the pair isolates its
  cost (the tree of partial sums, the invariant reduce path, the invariant clip norm and loss mean);
* ``invariant_uU``: ``InvariantUnits(units=U)``: one backward per unit, ``reduce()``, ``clip_grad_norm_``,
  ``mean`` of the units' losses.

Every variant clips at 1.0 (``perparam.clip_grad_norm_`` in the normal ones) and steps AdamW. Timing: rounds
of one step of each variant, the order rotating every round (the first ``--warmup`` dropped); a step's
time is the slower rank's; paired ratios are medians over rounds of (variant / its baseline in the same
round); CPU time (process, all threads) per rank alongside. Memory (after the timing rounds, their models
freed, glibc's mmap threshold then fixed at 4 MiB so freed tensors leave the resident set): each variant
built anew and alone, the peak ``VmHWM`` of its second step
over ``VmRSS`` before it; and the gradient buffers held at the end of each backward (the unsharded
accumulators; in the mode, plus the tree's partial sums), their peak against one rank's gradient shard.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

UNITS = (4, 8)
MAX_NORM = 1.0


def variants(units: tuple[int, ...]) -> list[str]:
    """``plain``, then per U ``accum_uU`` and ``invariant_uU``."""
    return ["plain"] + [f"{kind}_u{u}" for u in units for kind in ("accum", "invariant")]


def baseline(name: str) -> str:
    """The variant ``name`` is paired against first: ``invariant_uU`` -> ``accum_uU``; others -> ``plain``."""
    return name.replace("invariant", "accum") if name.startswith("invariant") else "plain"


class Variant:
    """One model, its AdamW and (``invariant_uU``) its ``InvariantUnits``; ``step`` runs one optimizer step on
    this rank's share of a global batch and returns its phase times (s)."""

    def __init__(self, name: str, cfg, mesh, rank: int, world: int) -> None:
        import perparam
        from benchmarks.harness.configs import build
        from benchmarks.harness.runner import model_groups

        self.name, self.rank, self.world = name, rank, world
        self.model, self.opt = build("perparam", cfg, mesh, 0)
        self.params = [p for g in model_groups(self.model) for p in g.params]
        self.units = int(name.rsplit("_u", 1)[1]) if "_u" in name else world
        self.iu = (perparam.InvariantUnits(self.model, units=self.units, seed=0)
                   if name.startswith("invariant") else None)
        self.grad_peak = 0  # bytes of gradient buffers held at the end of a backward, the most seen

    def _held(self) -> int:
        acc = sum(p.grad_acc.nbytes for p in self.params if p.grad_acc is not None)
        return acc + (self.iu.held_bytes() if self.iu is not None else 0)

    def step(self, x, y) -> tuple[dict[str, float], float]:
        import torch
        import torch.distributed as dist

        import perparam

        t0 = _now()
        losses = []
        if self.iu is not None:
            for u, (xu, yu) in self.iu.split((x, y)):
                with self.iu.unit(u, self._step):
                    loss = self.model(xu, yu)
                    loss.backward()
                    self.grad_peak = max(self.grad_peak, self._held())
                losses.append(loss.detach())
            t1 = _now()
            self.iu.reduce()
            t2 = _now()
            self.iu.clip_grad_norm_(MAX_NORM)
            reported = float(self.iu.mean(losses))
        else:
            n = self.units // self.world
            rows = x.shape[0] // self.world
            xs = x[self.rank * rows:(self.rank + 1) * rows].chunk(n)
            ys = y[self.rank * rows:(self.rank + 1) * rows].chunk(n)
            for i, (xu, yu) in enumerate(zip(xs, ys)):
                self.model.set_requires_gradient_sync(i == n - 1)
                loss = self.model(xu, yu) / n
                loss.backward()
                if i < n - 1:
                    self.grad_peak = max(self.grad_peak, self._held())
                losses.append(loss.detach())
            t1 = t2 = _now()
            perparam.clip_grad_norm_(self.model.parameters(), MAX_NORM)
            mean = torch.stack(losses).sum() / self.world  # the loss to report: the global batch's mean
            dist.all_reduce(mean)
            reported = float(mean)
        t3 = _now()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t4 = _now()
        self._step += 1
        marks = {"backward": (t0, t1), "reduce": (t1, t2), "clip": (t2, t3), "optimizer": (t3, t4)}
        return {f"{k}{suffix}": b[i] - a[i] for k, (a, b) in marks.items()
                for i, suffix in ((0, ""), (1, "_cpu"))}, \
            reported

    _step = 0


def _now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _shard_bytes(v: Variant) -> tuple[int, int]:
    """(one rank's gradient shard, the unsharded gradient) bytes of the trainable parameters, fp32."""
    shard = sum(p.sharded.to_local().numel() * 4 for p in v.params if p.sharded.requires_grad)
    full = sum(p.sharded.numel() * 4 for p in v.params if p.sharded.requires_grad)
    return shard, full


def _timing(rank: int, world: int, opts: dict, cfg, mesh, batches) -> dict:
    import torch.distributed as dist

    names = variants(tuple(opts["units"]))
    built = [Variant(n, cfg, mesh, rank, world) for n in names]
    wall = {n: [] for n in names}
    cpu = {n: [] for n in names}
    phases = {n: [] for n in names}
    losses = {n: [] for n in names}
    loads = []
    for r in range(opts["warmup"] + opts["rounds"]):
        x, y = batches[r % len(batches)]
        k = r % len(built)
        for v in built[k:] + built[:k]:
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            ph, loss = v.step(x, y)
            t1, c1 = time.perf_counter(), time.process_time()
            if r >= opts["warmup"]:
                wall[v.name].append(t1 - t0)
                cpu[v.name].append(c1 - c0)
                phases[v.name].append(ph)
            losses[v.name].append(loss)
        loads.append(os.getloadavg())
    return {"wall": wall, "cpu": cpu, "phases": phases, "losses": losses, "loadavg": loads}


def _memory(rank: int, world: int, opts: dict, cfg, mesh, batches) -> dict:
    from benchmarks.harness import memory

    out = {}
    for name in variants(tuple(opts["units"])):
        memory.trim()
        v = Variant(name, cfg, mesh, rank, world)
        v.step(*batches[0])  # the optimizer state exists from here on
        v.grad_peak = 0
        memory.trim()
        before = memory.vm_status()["VmRSS"]
        memory.reset_peak()
        v.step(*batches[1 % len(batches)])
        peak = memory.vm_status()["VmHWM"]
        shard, full = _shard_bytes(v)
        out[name] = {"rss_before": before, "step_peak": peak, "peak_over_start": peak - before,
                     "grad_buffer_peak": v.grad_peak, "shard_grad_bytes": shard, "unsharded_grad_bytes": full}
        del v
    return out


def _rank(rank: int, world: int, port: int, opts: dict, queue) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.harness import memory
    from benchmarks.harness.launch import init_gloo
    from benchmarks.harness.model import GPTConfig, make_batches

    init_gloo(rank, world, port)
    cfg = GPTConfig.quick() if opts["quick"] else GPTConfig()
    mesh = init_device_mesh("cpu", (world,))
    batches = make_batches(cfg, 4, opts["batch"], seed=0)
    result = {}
    try:
        for job in opts.get("jobs", [opts.get("job")]):
            if job == "memory":  # every variant is built anew after this, each alone
                memory.trim()
                memory.set_mmap_threshold(4 * 1024 * 1024)
            result[job] = (_timing if job == "timing" else _memory)(rank, world, opts, cfg, mesh, batches)
            memory.trim()
    except BaseException:
        import traceback

        queue.put((rank, {"error": traceback.format_exc()}))
        raise
    queue.put((rank, result if "jobs" in opts else result[opts["job"]]))
    dist.barrier()
    dist.destroy_process_group()


def summarise(timing: list[dict] | None, mem: list[dict] | None, opts: dict) -> dict:
    """Per variant: median step (slower rank per round), paired ratios, CPU per rank, phases (rank 0), final
    loss; memory figures (max over ranks) with the target ``log2(U) x`` one rank's gradient shard."""
    names = variants(tuple(opts["units"]))
    out = {n: _timing_summary(timing, n) if timing else {} for n in names}
    if mem is not None:
        for n in names:
            out[n]["memory"] = {k: max(r[n][k] for r in mem) for k in mem[0][n]}
        for n in names:
            if n.startswith("invariant"):
                m, base = out[n]["memory"], out[baseline(n)]["memory"]
                u = int(n.rsplit("_u", 1)[1])
                m["extra_grad_buffer_bytes"] = m["grad_buffer_peak"] - base["grad_buffer_peak"]
                m["extra_peak_over_start_bytes"] = m["peak_over_start"] - base["peak_over_start"]
                m["target_bytes"] = int(math.log2(u)) * m["shard_grad_bytes"]
    return out


def _timing_summary(timing: list[dict], n: str) -> dict:
    rounds = len(timing[0]["wall"][n])
    step = {v: [max(t["wall"][v][i] for t in timing) for i in range(rounds)]
            for v in {n, "plain", baseline(n)}}
    rec = {"step_s": statistics.median(step[n]), "step_times_s": step[n],
           "cpu_s_per_rank": [statistics.median(t["cpu"][n]) for t in timing],
           "phase_s_rank0": {k: statistics.median(p[k] for p in timing[0]["phases"][n])
                             for k in timing[0]["phases"][n][0]},
           "final_loss": timing[0]["losses"][n][-1]}
    for base in {"plain", baseline(n)}:
        rec[f"paired_vs_{base}"] = statistics.median(a / b for a, b in zip(step[n], step[base]))
        rec[f"cpu_paired_vs_{base}_per_rank"] = [
            statistics.median(a / b for a, b in zip(t["cpu"][n], t["cpu"][base])) for t in timing]
    return rec


def render(result: dict) -> str:
    mib = 2 ** 20
    lines = ["| variant | step ms | paired vs accum (same U) | paired vs plain | CPU ms/rank | CPU paired vs "
             "accum | CPU ms bwd / reduce / clip / opt (rank 0) | step peak over start MiB | grad buffers "
             "MiB (peak) | extra vs accum MiB | target log2(U) x shard MiB | final loss |", "|" + "---|" * 12]
    for n, r in result["variants"].items():
        base = baseline(n)
        m = r.get("memory", {})
        extra = f"{m['extra_grad_buffer_bytes'] / mib:.1f}" if "extra_grad_buffer_bytes" in m else "-"
        target = f"{m['target_bytes'] / mib:.1f}" if "target_bytes" in m else "-"
        if "step_s" in r:
            ph = r["phase_s_rank0"]
            timed = (f"{r['step_s'] * 1e3:.0f} | {r[f'paired_vs_{base}']:.3f} | {r['paired_vs_plain']:.3f} | "
                     + " / ".join(f"{c * 1e3:.0f}" for c in r["cpu_s_per_rank"]) + " | "
                     + " / ".join(f"{c:.3f}" for c in r[f"cpu_paired_vs_{base}_per_rank"]) + " | "
                     + " / ".join(f"{ph[k + '_cpu'] * 1e3:.0f}"
                                  for k in ("backward", "reduce", "clip", "optimizer")))
        else:
            timed = " | ".join("-" * 6)
        lines.append(f"| {n} | {timed} | "
                     + (f"{m['peak_over_start'] / mib:.1f} | {m['grad_buffer_peak'] / mib:.1f} | " if m
                        else "- | - | ")
                     + f"{extra} | {target} | "
                     + (f"{r['final_loss']:.4f} |" if "final_loss" in r else "- |"))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--rounds", type=int, help="timed rounds (default 8; --quick 3)")
    ap.add_argument("--warmup", type=int, help="untimed rounds first (default 1)")
    ap.add_argument("--batch", type=int, default=8, help="global batch, sequences (default 8)")
    ap.add_argument("--units", default=",".join(map(str, UNITS)), help="the U to measure (default 4,8)")
    ap.add_argument("--quick", action="store_true", help="the toy model, few rounds")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory run")
    ap.add_argument("--no-timing", action="store_true", help="skip the timing rounds (the memory run only)")
    args = ap.parse_args(argv)
    args.units = tuple(int(u) for u in args.units.split(","))
    if args.no_memory and args.no_timing:
        ap.error("--no-memory with --no-timing leaves nothing to run")
    for u in args.units:
        if u & (u - 1) or u < args.world or u % args.world or args.batch % u:
            ap.error(f"--units {u}: must be a power of two, a multiple of --world {args.world} dividing "
                     f"--batch {args.batch}")
    if args.rounds is not None and args.rounds < 1:
        ap.error(f"--rounds must be at least 1 (got {args.rounds})")
    if args.warmup is not None and args.warmup < 0:
        ap.error(f"--warmup must be 0 or more (got {args.warmup})")
    return args


def _ranks(spawn_ranks, world: int, opts: dict) -> list[dict]:
    """Each rank's results of the jobs ``opts["jobs"]`` (timing, then memory); ``RuntimeError`` with the first
    failing rank's traceback."""
    results = [r for _, r in spawn_ranks(_rank, world, opts)]
    failed = [r["error"] for r in results if "error" in r]
    if failed:
        raise RuntimeError(f"invariant_step failed on a rank\n{failed[0]}")
    return results


def main(argv: list[str] | None = None) -> dict:
    from benchmarks.harness.launch import spawn_ranks, write_json
    from benchmarks.harness.model import GPTConfig, count_params
    from benchmarks.harness.report import machine_info

    args = parse_args(argv)
    opts = {"quick": args.quick, "batch": args.batch, "units": list(args.units),
            "rounds": args.rounds or (3 if args.quick else 8),
            "warmup": 1 if args.warmup is None else args.warmup}
    started = _dt.datetime.now(_dt.timezone.utc)
    load0 = os.getloadavg()
    jobs = ([] if args.no_timing else ["timing"]) + ([] if args.no_memory else ["memory"])
    if args.quick:  # one set of ranks runs both (the smoke test: one launch)
        ranks = _ranks(spawn_ranks, args.world, {**opts, "jobs": jobs})
    else:  # the memory run in fresh ranks: the timing rounds' freed heap would blur its peaks
        ranks = [{} for _ in range(args.world)]
        for job in jobs:
            for mine, theirs in zip(ranks, _ranks(spawn_ranks, args.world, {**opts, "jobs": [job]})):
                mine.update(theirs)
    timing = None if args.no_timing else [r["timing"] for r in ranks]
    mem = None if args.no_memory else [r["memory"] for r in ranks]
    cfg = GPTConfig.quick() if args.quick else GPTConfig()
    n_params = count_params(cfg)
    loads = [load0] + (timing[0]["loadavg"] if timing else []) + [os.getloadavg()]
    result = {"meta": {"date": started.isoformat(timespec="seconds"), "command": " ".join(sys.argv),
                       "machine": machine_info(), "world_size": args.world, "quick": args.quick,
                       "model": {**cfg.as_dict(), "params": n_params}, "global_batch": args.batch, **opts,
                       "loadavg_1min": {"min": min(x[0] for x in loads), "max": max(x[0] for x in loads),
                                        "mean": statistics.fmean(x[0] for x in loads)},
                       "seconds": (_dt.datetime.now(_dt.timezone.utc) - started).total_seconds()},
              "variants": summarise(timing, mem, opts)}
    print(f"K = {args.world}, {n_params / 1e6:.1f}M parameters, global batch {args.batch}, {opts['rounds']} "
          "rounds, load average "
          f"{result['meta']['loadavg_1min']['min']:.1f}-{result['meta']['loadavg_1min']['max']:.1f}")
    print(render(result))
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
