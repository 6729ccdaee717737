"""CPU per step of the all-gathers alone: every group of the benchmark model unsharded and freed as a step
does (15 all-gathers: forward and backward, ``[ln_f, head]`` once), by all-gather algorithm, A/B in one run.

    python -m benchmarks.gather_step --rounds 12 [--quick] [--algorithms all_to_all,zero_copy]

Per rank: process CPU time (all threads) of one sweep, by algorithm in ABBA order; paired: the median
over rounds of (algorithm / the first one). The figure the zero-copy all-gather is judged on
(``perparam/runtime/zero_copy.py``): the whole step's CPU varies by more than the copies it saves on a
shared machine.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import perparam
    from benchmarks.configs import build
    from benchmarks.model import GPTConfig
    from perparam.runtime.group import group_of

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    cfg = GPTConfig.quick() if args.quick else GPTConfig()
    model, _ = build(args.config, cfg, init_device_mesh("cpu", (world,)), 0)
    groups = []
    for m in model.modules():
        g = group_of(m)
        if g is not None and g.params and all(g is not h for h in groups):
            groups.append(g)
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
    first = algorithms[0]
    paired = {a: statistics.median(t / f for t, f in zip(times[a], times[first])) for a in algorithms}
    queue.put((rank, {a: statistics.median(t) for a, t in times.items()}, paired, len(sweep)))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--algorithms", default="all_to_all,zero_copy")
    ap.add_argument("--config", default="perparam", help="a benchmarks.configs configuration (default perparam)")
    ap.add_argument("--quick", action="store_true", help="the toy model")
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = random.randint(20000, 40000)
    procs = [ctx.Process(target=_rank, args=(r, 2, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get() for _ in procs)
    for p in procs:
        p.join()
    load = os.getloadavg()
    print(f"{args.config}, {results[0][3]} all-gathers per sweep, {args.rounds} rounds, load {load[0]:.2f}")
    for rank, med, paired, _ in results:
        print(f"rank {rank}: " + ", ".join(f"{a} {med[a] * 1e3:.1f} ms CPU (paired {paired[a]:.3f})" for a in med))


if __name__ == "__main__":
    main()
