"""Step time, model-state bytes, training-phase peak RSS and bytes communicated: a compute-only bound,
DDP, torch FSDP2 (fp32 and bf16) and perparam, in one run.

    python -m benchmarks.step_time --json runs/bench/step_time.json [--world 4]

Every configuration trains the same model (``benchmarks/harness/model.py``) from the same weights
(``benchmarks/harness/configs.py``) on the same data over gloo, ``--world`` ranks on 127.0.0.1, one thread per
rank; the script starts its own ranks (``benchmarks/harness/launch.py``). What a rank runs:
``benchmarks/harness/runner.py``; RSS: ``benchmarks/harness/memory.py``; summary and tables:
``benchmarks/harness/report.py``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


from benchmarks.harness.configs import CONFIGS
from benchmarks.harness.launch import check_counts, launch, launch_many, write_json
from benchmarks.harness.model import GPT, GPTConfig, num_params
from benchmarks.harness.report import add_ratios, bf16_speed, machine_info, render, summarise


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; bad values exit with a one-line error naming the flag."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--world", type=int, default=2,
                    help="ranks (default 2; more than the cores oversubscribes)")
    ap.add_argument("--steps", type=int, help="timed rounds (default 20; --quick 3)")
    ap.add_argument("--warmup", type=int, help="untimed rounds first (default 3; --quick 1)")
    ap.add_argument("--quick", action="store_true", help="toy model and few steps (smoke test)")
    ap.add_argument("--configs",
                    help=f"comma-separated subset of {','.join(CONFIGS)} (default: all; without --quick "
                         "the bf16 ones are left out where this CPU emulates bf16)")
    ap.add_argument("--batch-per-rank", type=int, default=2, help="sequences per rank per step (default 2)")
    ap.add_argument("--rss-steps", type=int, help="steps of each memory run (default 3; --quick 2)")
    ap.add_argument("--no-rss", action="store_true", help="skip the per-configuration memory runs")
    ap.add_argument("--mmap-threshold", type=int, default=4 << 20,
                    help="bytes: also run each memory run under mallopt(M_MMAP_THRESHOLD, this), a glibc "
                         "that returns freed large blocks at once (default 4194304; 0: skip)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds before a job is killed")
    args = ap.parse_args(argv)
    args.configs_named = args.configs is not None
    args.configs = [c for c in (args.configs or ",".join(CONFIGS)).split(",") if c]
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        ap.error(f"--configs: unknown configurations {sorted(unknown)}; choose from {','.join(CONFIGS)}")
    if args.world < 2:
        ap.error(f"--world must be at least 2 (got {args.world}); sharding over one rank is not measured "
                 "here")
    check_counts(ap, args, ("steps", "rss_steps", "batch_per_rank"))
    args.steps = args.steps if args.steps is not None else (3 if args.quick else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.rss_steps = args.rss_steps if args.rss_steps is not None else (2 if args.quick else 3)
    return args


def drop_emulated_bf16(args) -> None:
    """Without ``--configs`` (and without ``--quick``), leave out the bf16 configurations where this CPU
    emulates bf16 matmuls (``report.bf16_speed``: 20-25x an fp32 matmul on AVX2 hosts, ~47 s a step on
    this model, issue 24), saying so in one line; naming them in ``--configs`` runs them anyway."""
    if args.configs_named or args.quick or not bf16_speed()["bf16_emulated"]:
        return
    skipped = [c for c in args.configs if "bf16" in c]
    args.configs = [c for c in args.configs if "bf16" not in c]
    print(f"left out {','.join(skipped)}: this CPU emulates bf16 matmuls (their steps would take ~20x longer "
          "and say nothing of bf16 where it is native); name them in --configs to run them anyway",
          flush=True)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    drop_emulated_bf16(args)
    cfg = GPTConfig.quick() if args.quick else GPTConfig()
    world = args.world
    opts = {"model": cfg.as_dict(), "configs": args.configs, "steps": args.steps, "warmup": args.warmup,
            "seed": args.seed, "batch_per_rank": args.batch_per_rank, "rss_steps": args.rss_steps,
            "timeout": args.timeout}

    started = _dt.datetime.now(_dt.timezone.utc)
    load_start = os.getloadavg()
    per_rank = launch("timing", opts, world)
    load_end = os.getloadavg()
    rss, rss_returning = {}, {}
    if not args.no_rss:
        names = [n for n in args.configs if per_rank[0]["configs"][n]["status"] == "ok"]
        thresholds = [None] + ([args.mmap_threshold] if args.mmap_threshold else [])
        jobs = [(n, t) for t in thresholds for n in names]
        run_opts = [("rss", {**opts, "config": n, "mmap_threshold": t}) for n, t in jobs]
        if args.quick:  # toy model: the memory jobs side by side (their RSS does not depend on timing)
            results = launch_many(run_opts, world)
        else:  # one at a time, so the machine's memory is not the limit
            results = [launch(job, o, world) for job, o in run_opts]
        rss = {n: r for (n, t), r in zip(jobs, results) if t is None}
        rss_returning = {n: r for (n, t), r in zip(jobs, results) if t is not None}
    loads = [la[0] for la in per_rank[0]["loadavg"]]
    params = num_params(GPT(cfg))
    result = {
        "meta": {
            "date": started.isoformat(timespec="seconds"),
            "command": " ".join(["python -m benchmarks.step_time", *sys.argv[1:]]),
            "machine": machine_info(), "world_size": world, "threads_per_rank": 1, "backend": "gloo",
            "oversubscribed": world > (os.cpu_count() or 1), "model": cfg.as_dict(), "model_params": params,
            "batch_per_rank": args.batch_per_rank, "steps": args.steps, "warmup": args.warmup,
            "rss_steps": args.rss_steps, "quick": args.quick,
            "returning_allocator": (f"mallopt(M_MMAP_THRESHOLD, {args.mmap_threshold}) in each rank before "
                                    "building"
                                    if args.mmap_threshold and not args.no_rss else None),
            "loadavg": {"start": list(load_start), "end": list(load_end), "min": min(loads),
                        "max": max(loads), "mean": statistics.mean(loads)},
        },
        "configs": {name: summarise(name, per_rank, rss.get(name), world, rss_returning.get(name))
                    for name in args.configs},
    }
    add_ratios(result["configs"], 4 * params, world)
    write_json(args.json, result)
    render(result)
    return result


if __name__ == "__main__":
    main()
