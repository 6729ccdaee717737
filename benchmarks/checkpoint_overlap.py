"""Step time while ``perparam.checkpoint.async_save`` writes in the background, against plain steps and a
blocking ``save``.

    python -m benchmarks.checkpoint_overlap [--nproc 2] [--width 1024] [--rounds 4] [--json out.json]

A ``--width``-wide 4-layer MLP (4 x ``Linear(width, width)``: 4.2M fp32 parameters at 1024, with AdamW state
50 MB in all) sharded over ``--nproc`` gloo ranks, one thread each, batch 64 per rank. Each round: two plain
steps, then ``async_save`` (the time until it returns: the CPU snapshot), then steps until the write is done
(the steps that began while it was in flight), then a blocking ``save`` of the same state. Reported per rank
0: the median plain step, the median in-flight step and their ratio, the ``async_save`` return time, the
background write's duration (in-flight steps sharing the cores) and the blocking save's, and the training time
a save costs each way (``async_cost_per_save_s``: return time plus the in-flight steps' excess per round).
Checkpoints go to a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path


def _rank(rank: int, world: int, store_path: str, folder: str, width: int, rounds: int, conn) -> None:
    import gc

    import torch
    import torch.distributed as dist

    from perparam import checkpoint

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        conn.send(_measure(folder, width, rounds))
    finally:
        checkpoint.wait_pending()
        gc.collect()  # the sharded model before the process group
        dist.destroy_process_group()


def _measure(folder: str, width: int, rounds: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn

    import perparam
    from perparam import checkpoint

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])
    for layer in model:
        perparam.fully_shard(layer)
    perparam.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(64, width)

    def step() -> float:
        began = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - began

    for _ in range(2):
        step()  # warm-up: AdamW state exists from here on
    plain, flight, returns, writes, blocking = [], [], [], [], []
    for r in range(rounds):
        plain += [step(), step()]
        began = time.perf_counter()
        pending = checkpoint.async_save(f"{folder}/async-{r:03d}", model, opt, keep=1)
        returns.append(time.perf_counter() - began)
        while True:  # steps while the write is in flight (rank 0 decides, so all ranks run the same steps)
            done = torch.tensor([int(pending.done())])
            dist.broadcast(done, src=0)
            if done.item():
                break
            flight.append(step())
        pending.wait()
        writes.append(time.perf_counter() - began)
        began = time.perf_counter()
        checkpoint.save(f"{folder}/sync-{r:03d}", model, opt, keep=1)
        blocking.append(time.perf_counter() - began)
    med = statistics.median
    return {"plain_step_s": med(plain), "in_flight_step_s": med(flight) if flight else None,
            "in_flight_steps": len(flight), "plain_steps": len(plain),
            "in_flight_vs_plain": med(flight) / med(plain) if flight else None,
            "async_save_returns_s": med(returns), "background_write_s": med(writes),
            "blocking_save_s": med(blocking),
            # training time a save costs: the snapshot plus the in-flight steps' slowdown, against the
            # blocking save's whole duration
            "async_cost_per_save_s": med(returns) + (sum(flight) - len(flight) * med(plain)) / rounds,
            "state_bytes_per_rank": sum(t.to_local().numel() * 4 for t in model.parameters()) * 3}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="perparam-ckpt-overlap-") as tmp:
        conns, procs = [], []
        for rank in range(args.nproc):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_rank, args=(rank, args.nproc, f"{tmp}/store", f"{tmp}/ckpt", args.width,
                                                args.rounds, child))
            p.start()
            conns.append(parent)
            procs.append(p)
        result = conns[0].recv()
        for p in procs:
            p.join(timeout=60)
    result.update(nproc=args.nproc, width=args.width, rounds=args.rounds, loadavg_1min=os.getloadavg()[0],
                  cpus=os.cpu_count())
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
