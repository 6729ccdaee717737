"""CPU time per step of one configuration on K gloo ranks, and where rank 0 spends it (cProfile, or
per phase and category).

    python -m benchmarks.profile_step perparam --steps 6 [--gloo-reduce-scatter native]
        [--gloo-all-gather native] [--top 25]
    python -m benchmarks.profile_step perparam --size 110m --batch-per-rank 1 --steps 3 --categories
    python -m benchmarks.profile_step perparam --steps 16 --top 0 \
        --versus gloo_all_gather=all_to_all,local_optimizer_step=0     # A/B within one run, paired

CPU time (``time.process_time``, all threads of a rank's process) is the figure to drive down on a shared
2-core machine: it is little affected by other load. Reported per step: CPU ms of each rank (median),
then rank 0's cProfile of the timed steps, sorted by own time (``tottime``); with ``--categories`` instead
rank 0's CPU ms per step and phase in compute, copies, collectives, allocation, Python by package and
other threads (``benchmarks/harness/step_categories.py``).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

from benchmarks.harness.configs import CONFIGS
from benchmarks.harness.model import SIZES
from perparam.runtime.config import (
    GLOO_ALL_GATHER_ALGORITHMS,
    GLOO_REDUCE_SCATTER_ALGORITHMS,
    RuntimeConfig,
)


def _fields(text: str) -> dict:
    """``'gloo_all_gather=all_to_all,local_optimizer_step=0'`` -> configure's keyword arguments."""
    out = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        out[key.strip()] = {"0": False, "1": True, "false": False, "true": True}.get(value.strip().lower(),
                                                                                     value.strip())
    return out


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    import cProfile
    import dataclasses
    import io
    import pstats
    import statistics
    import time

    import torch.distributed as dist

    import perparam
    from benchmarks.harness.launch import init_and_build
    from benchmarks.harness.model import make_batches, sized
    from benchmarks.harness.runner import local_batch
    from benchmarks.harness.step_categories import PHASES, categorize, render

    perparam.configure(gloo_reduce_scatter=args.gloo_reduce_scatter, gloo_all_gather=args.gloo_all_gather)
    cfg = sized("quick" if args.quick else args.size)
    model, opt = init_and_build(rank, world, port, args.config, cfg)
    x, y = local_batch(make_batches(cfg, 1, args.batch_per_rank * world)[0], rank, world)

    phase_prof = {ph: cProfile.Profile(time.thread_time) for ph in PHASES}  # --categories: CPU, per phase
    phase_cpu = dict.fromkeys(PHASES, 0.0)

    def forward():
        opt.zero_grad(set_to_none=True)
        return model(x, y)

    def step(profiled: bool = False):
        out = None
        for ph in PHASES:
            c0 = time.process_time()
            if profiled:
                phase_prof[ph].enable()
            if ph == "forward":
                out = forward()
            elif ph == "backward":
                out.backward()
            else:
                opt.step()
            if profiled:
                phase_prof[ph].disable()
                phase_cpu[ph] += time.process_time() - c0

    for _ in range(2):
        step()
    base = perparam.configure()
    other = dataclasses.replace(base, **_fields(args.versus)) if args.versus else base
    prof, cpu, versus = cProfile.Profile(), [], []
    for i in range(args.steps):
        b_turn = args.versus is not None and (i % 4 in (1, 2))  # ABBA: A, B, B, A, ...
        perparam.configure(**dataclasses.asdict(other if b_turn else base))
        dist.barrier()
        c0 = time.process_time()
        if rank == 0 and args.top and not args.categories and not b_turn:
            prof.enable()
        step(profiled=rank == 0 and args.categories)
        if rank == 0 and args.top and not args.categories and not b_turn:
            prof.disable()
        (versus if b_turn else cpu).append(time.process_time() - c0)
    if versus:  # paired: the median of B / A over the ABBA pairs
        pairs = [versus[j] / cpu[j] for j in range(min(len(cpu), len(versus)))]
        text_ab = (f"A/B rank {rank}: A {statistics.median(cpu) * 1e3:.0f} ms, "
                   f"B ({args.versus}) {statistics.median(versus) * 1e3:.0f} ms, paired B/A "
                   f"{statistics.median(pairs):.3f} over {len(pairs)} pairs")
        print(text_ab, flush=True)
    text = ""
    if rank == 0 and args.categories:
        text = (f"rank 0, CPU per step (mean of {args.steps}, cProfile(time.thread_time) per phase):\n"
                + render({ph: categorize(phase_prof[ph], args.steps) for ph in PHASES},
                         {ph: phase_cpu[ph] * 1e3 / args.steps for ph in PHASES}))
    elif rank == 0 and args.top:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(args.sort).print_stats(args.top)
        text = buf.getvalue()
    queue.put((rank, statistics.median(cpu), text))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", choices=CONFIGS)
    ap.add_argument("--steps", type=int, default=6, help="profiled steps after 2 warm-up steps (default 6)")
    ap.add_argument("--top", type=int, default=25, help="functions listed (0: none; no profiler overhead)")
    ap.add_argument("--gloo-reduce-scatter", choices=GLOO_REDUCE_SCATTER_ALGORITHMS,
                    default=RuntimeConfig.gloo_reduce_scatter,
                    help="perparam.configure(gloo_reduce_scatter=...) (default: perparam's)")
    ap.add_argument("--gloo-all-gather", choices=GLOO_ALL_GATHER_ALGORITHMS, default="zero_copy",
                    help="perparam.configure(gloo_all_gather=...) (default zero_copy)")
    ap.add_argument("--versus", default=None, metavar="FIELD=VALUE,...",
                    help="A/B: alternate steps (ABBA) between the configuration above and this one, e.g. "
                         "'gloo_all_gather=all_to_all,local_optimizer_step=0' (reports both, paired)")
    ap.add_argument("--sort", choices=("tottime", "cumtime"), default="tottime",
                    help="profile order (default tottime)")
    ap.add_argument("--quick", action="store_true", help="the toy model (--size quick)")
    ap.add_argument("--size", choices=tuple(SIZES), default="27m", help="model size (default 27m)")
    ap.add_argument("--batch-per-rank", type=int, default=2, help="sequences per rank (default 2)")
    ap.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--categories", action="store_true",
                    help="CPU ms per step by phase and category instead of cProfile's functions")
    args = ap.parse_args(argv)
    from benchmarks.harness.launch import spawn_ranks

    results = spawn_ranks(_rank, args.world, args)
    print(f"{args.config} (gloo reduce-scatter: {args.gloo_reduce_scatter}, all-gather: "
          f"{args.gloo_all_gather}): CPU ms per step, median of {args.steps}: "
          + ", ".join(f"rank {r} {c * 1e3:.0f}" for r, c, _ in results))
    print(results[0][2])


if __name__ == "__main__":
    main()
