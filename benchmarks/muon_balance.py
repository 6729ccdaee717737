"""How evenly the owner plan spreads Muon's work over the ranks, measured without oversubscription.

    python -m benchmarks.muon_balance                 # the 27.4M GPT's 24 Muon matrices, K = 2, 3, 4, 8
    python -m benchmarks.muon_balance --quick         # the toy model

``muon_step.py`` measures each rank's Newton-Schulz time while all ranks run at once; with 4 ranks on this
host's 2 cores that figure is the scheduler's, not the plan's. Here one process plays every rank in turn:
the owners come from ``perparam.sharding.owners.plan_shapes`` over the matrices in the optimizer's order
(what the runtime plans), each rank's matrices are stepped whole by the stock ``torch.optim.Muon`` (what its
owner runs: the momentum update, Newton-Schulz, the parameter update), one rank after another in a rotating
order, ``--rounds`` times after one step that builds the state. Per rank: the median step time; the balance
is the busiest rank's median over the mean of the medians (target <= 1.05 at K = 4, issue 34), beside the
planned one (``OwnerPlan.balance``, in multiply-adds). Also the one-process Muon step over all the matrices
and its 1/K share, the owner step's compute floor.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

HIDDEN = ("qkv.weight", "proj.weight", "fc.weight", "out.weight")


def hidden_shapes(quick: bool) -> list[tuple[int, ...]]:
    """The Muon matrices of the benchmark GPT (``muon_step.py``'s), in the optimizer's order."""
    from benchmarks.harness.configs import seeded_full_init
    from benchmarks.harness.model import GPTConfig

    model = seeded_full_init(GPTConfig.quick() if quick else GPTConfig(), 0)
    return [tuple(p.shape)
            for n, p in model.named_parameters() if n.startswith("blocks") and n.endswith(HIDDEN)]


def _optimizer(shapes, seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=gen))
        p.grad = torch.randn(s, generator=gen)
        params.append(p)
    return torch.optim.Muon(params, lr=0.02) if params else None


def _timed_step(opt) -> float:
    if opt is None:
        return 0.0
    t0 = time.perf_counter()
    opt.step()
    return time.perf_counter() - t0


def measure(shapes, k: int, rounds: int) -> dict:
    """Per-rank median step times (s) of ``k`` owners' Muon steps, taken in turn, and the balances."""
    import torch

    from perparam.sharding.owners import plan_shapes

    torch.set_num_threads(1)
    plan = plan_shapes(shapes, k)
    opts = [_optimizer([s for s, o in zip(shapes, plan.owners) if o == r], seed=r) for r in range(k)]
    for opt in opts:  # builds the momentum buffers
        _timed_step(opt)
    times: list[list[float]] = [[] for _ in range(k)]
    for i in range(rounds):
        for r in list(range(k))[i % k:] + list(range(k))[:i % k]:
            times[r].append(_timed_step(opts[r]))
    medians = [statistics.median(t) for t in times]
    mean = sum(medians) / k
    return {"k": k, "planned": plan.balance, "measured": max(medians) / mean if mean else 1.0,
            "medians_ms": [m * 1e3 for m in medians], "counts": [plan.owners.count(r) for r in range(k)]}


def one_process(shapes, rounds: int) -> float:
    """Median seconds of one ``torch.optim.Muon`` step over all ``shapes`` in one process."""
    opt = _optimizer(shapes, seed=99)
    _timed_step(opt)
    return statistics.median(_timed_step(opt) for _ in range(rounds))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the toy model")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--worlds", default="2,3,4,8", help="comma-separated K")
    args = ap.parse_args(argv)
    shapes = hidden_shapes(args.quick)
    whole = one_process(shapes, args.rounds)
    print(f"{len(shapes)} Muon matrices; one-process Muon step {whole * 1e3:.1f} ms (median of "
          f"{args.rounds})")
    for k in (int(x) for x in args.worlds.split(",")):
        r = measure(shapes, k, args.rounds)
        per = ", ".join(f"{m:.1f}" for m in r["medians_ms"])
        print(f"K = {k}: balance planned {r['planned']:.3f}, measured {r['measured']:.3f} (busiest / mean of "
              f"per-rank medians: {per} ms; matrices per rank {r['counts']}); 1/K of the one-process step "
              f"{whole * 1e3 / k:.1f} ms")


if __name__ == "__main__":
    main()
