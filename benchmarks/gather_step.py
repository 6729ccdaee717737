"""CPU per step of the all-gathers alone: every group of the benchmark model unsharded and freed as a step
does (15 all-gathers: forward and backward, ``[ln_f, head]`` once), by all-gather algorithm, A/B in one run.

    python -m benchmarks.gather_step --rounds 12 [--quick] [--algorithms all_to_all,zero_copy]

Per rank: process CPU time (all threads) of one sweep, by algorithm in ABBA order; paired: the median
over rounds of (algorithm / the first one). The figure the zero-copy all-gather is judged on
(``perparam/runtime/paths/gather_zero_copy.py``): the whole step's CPU varies by more than the copies it
saves on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    import torch.distributed as dist

    import perparam
    from benchmarks.harness.launch import init_and_build, paired_medians
    from benchmarks.harness.model import GPTConfig
    from benchmarks.harness.runner import model_groups

    cfg = GPTConfig.quick() if args.quick else GPTConfig()
    model, _ = init_and_build(rank, world, port, args.config, cfg)
    groups = model_groups(model)
    kept = groups[-1]  # [ln_f, head]: gathered once a step (kept from forward to backward)
    sweep = groups + [g for g in reversed(groups) if g is not kept]
    algorithms = args.algorithms.split(",")
    times: dict[str, list[float]] = {a: [] for a in algorithms}
    for i in range(args.rounds + 1):
        order = algorithms if i % 2 == 0 else algorithms[::-1]
        for algorithm in order:
            perparam.configure(gloo_all_gather=algorithm)
            dist.barrier()
            c0 = time.process_time()
            for g in sweep:
                g.unshard()
                g.free()
            if i:  # round 0 warms up
                times[algorithm].append(time.process_time() - c0)
    queue.put((rank, *paired_medians(times), len(sweep)))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    from benchmarks.harness.launch import ab_parser, paired_rank_line, spawn_ranks

    ap = ab_parser(__doc__)
    args = ap.parse_args(argv)
    results = spawn_ranks(_rank, 2, args)
    load = os.getloadavg()
    print(f"{args.config}, {results[0][3]} all-gathers per sweep, {args.rounds} rounds, load {load[0]:.2f}")
    for rank, med, paired, _ in results:
        print(paired_rank_line(rank, med, paired))


if __name__ == "__main__":
    main()
