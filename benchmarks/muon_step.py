"""Muon on sharded parameters: the owner path (``ParamPolicy(update="owner")``; ``owner``: gradients
reduce-scattered, ``owner_reduce``: reduced to their owners, ``configure(owner_grad="owner")``) against
today's DTensor-dispatch path (every rank runs Newton-Schulz on its row shards through DTensor: the wrong
result, for the time) and against the same model with AdamW only, in paired rounds.

    python -m benchmarks.muon_step --world 2 --rounds 6          # the 27.4M GPT (benchmarks/harness/model.py)
    python -m benchmarks.muon_step --world 4 --quick             # the toy model
    python -m benchmarks.muon_step --world 2 --variants adamw,owner,owner_reduce   # leave dispatch out

Muon steps the blocks' 2-D matrices (qkv, proj, fc, out), AdamW the rest (embeddings, head, norms, biases).
Per variant and rank: the median wall-clock step (forward, backward, both optimizer steps) and optimizer
step (ms), paired with the AdamW-only model's in the same round; ``CommCounter``'s collectives and bytes of
the optimizer steps (the owner path's all-to-alls, against ``3 (K-1)/K m n`` elements per matrix after a
reduce-scatter, ``2 (K-1)/K m n`` after a reduction to the owners) and of the backward's reductions; the
planned Newton-Schulz work of the busiest rank over the mean (``perparam.sharding.owners``) and the
measured Newton-Schulz time per rank. The dispatch path runs through a ``torch.optim.Muon`` subclass that
declares itself elementwise (``perparam_whole_matrix = False``, the documented way), since perparam refuses
the stock class on shards.
"""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

VARIANTS = ("adamw", "owner", "owner_reduce", "dispatch")
HIDDEN = ("qkv.weight", "proj.weight", "fc.weight", "out.weight")


def _build(variant: str, cfg, mesh):
    import torch

    import perparam
    from benchmarks.harness.configs import seeded_full_init, wrap_units

    class DispatchMuon(torch.optim.Muon):
        perparam_whole_matrix = False  # today's path: Newton-Schulz through DTensor dispatch on the shards

    model = seeded_full_init(cfg, 0)
    owner = perparam.ParamPolicy(update="owner")

    def policy(name, p):
        return owner if variant.startswith("owner") and name.endswith(HIDDEN) else None

    for modules, reshard in wrap_units(model):
        perparam.fully_shard(modules if len(modules) > 1 else modules[0], mesh=mesh,
                             reshard_after_forward=reshard, param_policy=policy)
    named = dict(model.named_parameters())
    if variant == "adamw":
        return model, [torch.optim.AdamW(model.parameters(), lr=3e-4)]
    hidden = [p for n, p in named.items() if n.startswith("blocks") and n.endswith(HIDDEN)]
    rest = [p for p in named.values() if all(p is not h for h in hidden)]
    muon = (torch.optim.Muon if variant.startswith("owner") else DispatchMuon)(hidden, lr=0.02)
    return model, [muon, torch.optim.AdamW(rest, lr=3e-4)]


def _rank(rank: int, world: int, port: int, quick: bool, rounds: int, variants: tuple, queue) -> None:
    import torch
    import torch.optim._muon as muon_module
    from torch.distributed.device_mesh import init_device_mesh

    import perparam
    from benchmarks.harness.launch import init_gloo
    from benchmarks.harness.model import GPTConfig, make_batches
    from perparam import CommCounter
    from perparam.runtime import owner_step

    init_gloo(rank, world, port)
    cfg = GPTConfig.quick() if quick else GPTConfig()
    mesh = init_device_mesh("cpu", (world,))
    built = {v: _build(v, cfg, mesh) for v in variants}
    ns_time = [0.0]
    original = muon_module._zeropower_via_newtonschulz

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = original(*args, **kwargs)
        ns_time[0] += time.perf_counter() - t0
        return out

    muon_module._zeropower_via_newtonschulz = timed
    batch = 8 if quick else 4
    batches = make_batches(cfg, rounds + 1, batch * world)
    step = {v: [] for v in variants}
    optim = {v: [] for v in variants}
    ns = {v: [] for v in variants}
    comm = {}
    for i, (idx, tgt) in enumerate(batches):
        idx, tgt = idx[rank * batch:(rank + 1) * batch], tgt[rank * batch:(rank + 1) * batch]
        n = len(variants)
        order = variants[i % n:] + variants[:i % n]
        for v in order:
            model, opts = built[v]
            perparam.configure(owner_grad="owner" if v == "owner_reduce" else "rows")
            torch.distributed.barrier()
            t0 = time.perf_counter()
            with CommCounter() as backward:
                model(idx, tgt).backward()
            t1 = time.perf_counter()
            ns_time[0] = 0.0
            with CommCounter() as counter:
                for opt in opts:
                    opt.step()
            t2 = time.perf_counter()
            for opt in opts:
                opt.zero_grad()
            if i:  # the first round builds the state
                step[v].append(t2 - t0)
                optim[v].append(t2 - t1)
                ns[v].append(ns_time[0])
            comm[v] = (counter.count("all_to_all"), counter.bytes("all_to_all"), counter.count("all_gather"),
                       counter.bytes("all_gather"), backward.count("reduce_scatter"),
                       backward.bytes("reduce_scatter"))
    muon_module._zeropower_via_newtonschulz = original
    perparam.configure(owner_grad="rows")
    owned = next(v for v in variants if v.startswith("owner"))
    route = owner_step.routing(built[owned][1][0])
    loads = next(iter(route.loads.values()))
    matrices = [(tuple(e.sp.global_shape), e.sp.sharded.dtype.itemsize) for b in route.buckets
                for e in b.entries]
    queue.put((rank, {v: (statistics.median(step[v]), statistics.median(optim[v]), statistics.median(ns[v]),
                          statistics.median(s / a for s, a in zip(step[v], step["adamw"])),
                          statistics.median(o / a for o, a in zip(optim[v], optim["adamw"])), comm[v])
                      for v in variants}, loads, matrices, len(route.buckets)))
    import torch.distributed as dist
    dist.barrier()
    del built
    import gc
    gc.collect()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    import argparse

    from benchmarks.harness.launch import spawn_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--quick", action="store_true", help="the toy model")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, from {','.join(VARIANTS)}; adamw and one owner variant required")
    args = ap.parse_args(argv)
    variants = tuple(args.variants.split(","))
    if "adamw" not in variants or not any(v.startswith("owner")
                                          for v in variants) or set(variants) - set(VARIANTS):
        ap.error(f"--variants: adamw, one of owner/owner_reduce and any of {VARIANTS}, got {args.variants!r}")
    results = spawn_ranks(_rank, args.world, args.quick, args.rounds, variants)
    k = args.world
    _, _, loads, matrices, buckets = results[0]
    owned = next(v for v in variants if v.startswith("owner"))
    elements = sum(m * n for (m, n), _ in matrices)
    itemsize = matrices[0][1]
    mean = sum(loads) / len(loads)
    print(f"K = {k}, {len(matrices)} Muon matrices ({elements:,} elements) in {buckets} bucket(s)")
    print(f"planned Newton-Schulz work: busiest rank {max(loads) / mean:.3f}x the mean (per rank "
          f"{list(loads)})")
    for v in variants:
        print(f"{v}:")
        for rank, figures, *_ in results:
            s, o, n, ps, po, (a2a, a2a_b, ag, ag_b, rs, rs_b) = figures[v]
            print(f"  rank {rank}: step {s * 1e3:.1f} ms (paired vs adamw {ps:.3f}), optimizer {o * 1e3:.1f} "
                  f"ms (paired {po:.3f}), Newton-Schulz {n * 1e3:.1f} ms; optimizer collectives: {a2a} "
                  f"all-to-all {a2a_b:,} B sent, {ag} all-gather {ag_b:,} B; backward: {rs} reductions "
                  f"{rs_b:,} B")
    for v, factor in (("owner", 3), ("owner_reduce", 2)):
        if v in variants:
            sent = sum(r[1][v][5][1] for r in results)
            print(f"{v} bytes on the wire per step, all ranks: {sent:,} B; {factor} (K-1)/K m n: "
                  f"{factor * (k - 1) * elements * itemsize // k:,} B")
    ns_ranks = [r[1][owned][2] for r in results]
    if sum(ns_ranks):
        print(f"measured Newton-Schulz time: busiest rank {max(ns_ranks) / (sum(ns_ranks) / k):.3f}x the "
              "mean")


if __name__ == "__main__":
    main()
