"""CPU per step of the gradient reductions alone: every group of the benchmark model reduces a fixed set of
unsharded gradients into fresh sharded ``.grad``s (packing or not, the transfer, the sum, the division),
by reduce-scatter algorithm, A/B in one run.

    python -m benchmarks.reduce_step --rounds 12 [--quick] [--algorithms all_to_all,zero_copy] [--world 2]

Per rank: process CPU time (all threads) of one sweep (each group's ``reduce_grads`` in reverse order, as a
backward issues them, then waited for), by algorithm in ABBA order; paired: the median over rounds of
(algorithm / the first one). The figure the zero-copy reduce-scatter is judged on
(``perparam/runtime/paths/reduce_zero_copy.py``); ``--check`` also asserts the algorithms' ``.grad``s
bitwise equal.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    import torch
    import torch.distributed as dist

    import perparam
    from benchmarks.harness.launch import init_and_build, paired_medians
    from benchmarks.harness.model import make_batches, sized
    from benchmarks.harness.runner import local_batch, model_groups

    cfg = sized("quick" if args.quick else args.size)
    model, opt = init_and_build(rank, world, port, args.config, cfg)
    x, y = local_batch(make_batches(cfg, 1, 2 * world)[0], rank, world)
    model(x, y).backward()  # a real step first: the groups' context, order and buffers
    groups = model_groups(model)
    gen = torch.Generator().manual_seed(rank)
    grads = {}
    for g in groups:
        g.unshard()
        for p in g.trainable():
            grads[id(p)] = torch.randn(p.unsharded.shape, generator=gen).to(p.unsharded.dtype)
    algorithms = args.algorithms.split(",")
    times: dict[str, list[float]] = {a: [] for a in algorithms}
    results = {}
    for i in range(args.rounds + 1):
        order = algorithms if i % 2 == 0 else algorithms[::-1]
        for algorithm in order:
            perparam.configure(gloo_reduce_scatter=algorithm)
            for g in groups:
                for p in g.trainable():
                    p.sharded.grad = None
                    p.unsharded.grad = grads[id(p)]
            dist.barrier()
            c0 = time.process_time()
            pending = [(g, item) for g in reversed(groups) for item in g.reduce_grads(sync=True, defer=True)]
            for g, item in pending:
                g.finish_reduce(item)
            groups[0].ctx.grad_hooks_due.clear()
            if i:  # round 0 warms up
                times[algorithm].append(time.process_time() - c0)
            if args.check and i == 0:
                results[algorithm] = [p.sharded.grad.to_local().clone() for g in groups
                                      for p in g.trainable()]
    if args.check:
        first = results[algorithms[0]]
        for a in algorithms[1:]:
            assert all(torch.equal(u, v)
                       for u, v in zip(first, results[a])), f"{a} differs from {algorithms[0]}"
    queue.put((rank, *paired_medians(times), len(groups)))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    from benchmarks.harness.launch import ab_parser, paired_rank_line, spawn_ranks

    ap = ab_parser(__doc__)
    ap.add_argument("--size", default="27m", help="model size (default 27m)")
    ap.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--check", action="store_true", help="assert the algorithms' gradients bitwise equal")
    args = ap.parse_args(argv)
    results = spawn_ranks(_rank, args.world, args)
    load = os.getloadavg()
    print(f"{args.config}, K={args.world}, {results[0][3]} reductions per sweep, {args.rounds} rounds, "
          f"load {load[0]:.2f}")
    for rank, med, paired, _ in results:
        print(paired_rank_line(rank, med, paired))


if __name__ == "__main__":
    main()
