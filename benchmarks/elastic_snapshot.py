"""What ``perparam.elastic``'s in-memory snapshots cost when nothing fails, what memory they take, and how
long a restore takes.

    python -m benchmarks.elastic_snapshot [--size 27m] [--nproc 2] [--rounds 3] [--steps 3] [--replica auto]
                                          [--json out.json]

The GPT of ``harness/model.py`` (``--size``: 27m is the 27.4M model of step_time.py) sharded by ``perparam``
over ``--nproc`` gloo ranks (one thread each, 2 sequences per rank), AdamW. Paired rounds: each round runs
``--steps`` steps without snapshots and ``--steps`` steps with ``State.commit()`` after each (the order of the
two halves alternates between rounds), timing wall and CPU (process) time per step. Then the shared memory
the slots map against the formula ``2 slots x (own payload + the payload of the rank whose replica it
holds, when replicas are kept)`` (``--replica``: ``State``'s placement; ``auto``, the default, keeps none on
this one host, ``always`` measures the replica path), and the time of ``State.restore()`` into a fresh model
and optimizer on the same ranks. Snapshots go to a temporary folder in ``/dev/shm``. Reported: rank 0's
medians and the ratio, the commit's time on the critical path, each rank's bytes.
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


def _rank(rank: int, world: int, store_path: str, root: str, size: str, rounds: int, steps: int, replica: str,
          conn) -> None:
    import gc

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    try:
        conn.send(_measure(root, size, rounds, steps, replica))
    finally:
        gc.collect()
        dist.destroy_process_group()


def _measure(root: str, size: str, rounds: int, steps: int, replica: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.harness.configs import build
    from benchmarks.harness.model import make_batches, sized
    from perparam.elastic import State
    from perparam.elastic.replica import neighbours

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = sized(size)
    mesh = init_device_mesh("cpu", (world,))
    model, opt = build("perparam", cfg, mesh, seed=0)
    batches = make_batches(cfg, 2 * rounds * steps + 2, 2 * world)
    state = State(model, opt, root=root, job="bench", replica=replica)
    it = iter(batches)

    def step(commit: bool) -> tuple[float, float, float]:
        idx, tgt = next(it)
        idx, tgt = idx.chunk(world)[rank], tgt.chunk(world)[rank]
        dist.barrier()
        w, c = time.perf_counter(), time.process_time()
        model(idx, tgt).backward()
        opt.step()
        opt.zero_grad()
        commit_s = 0.0
        if commit:
            state.commit()
            # the commit, and what this step's optimizer step waited for the last commit's copy
            commit_s = state.last_commit_s + state.last_wait_s
        return time.perf_counter() - w, time.process_time() - c, commit_s

    step(True)  # warm-up: optimizer state created, slots mapped
    plain, snap = [], []
    for r in range(rounds):
        for commit in ((False, True) if r % 2 == 0 else (True, False)):
            for _ in range(steps):
                (snap if commit else plain).append(step(commit))
    step(True)  # the restore below is compared with the model as this last snapshot holds it
    state.finish()
    own = state.store.own(state.step % 2).capacity
    owns: list = [None] * world
    dist.all_gather_object(owns, own)
    target, source = neighbours(rank, world)
    mapped = state.bytes_mapped()
    formula = 2 * (owns[rank] + (owns[source] if state.replica else 0))
    local_bytes = sum(t.numel() * t.element_size() for t in _locals(model, opt))
    fresh, fresh_opt = build("perparam", cfg, mesh, seed=1)
    again = State(fresh, fresh_opt, root=root, job="bench", replica=replica)
    dist.barrier()
    t = time.perf_counter()
    restored = again.restore()
    restore_s = time.perf_counter() - t
    same = all(torch.equal(a.to_local(), b.to_local())
               for a, b in zip(model.parameters(), fresh.parameters()))
    state.close(remove_snapshots=False)
    again.close()
    med = statistics.median
    return {"rank": rank, "plain_wall_s": med(p[0] for p in plain), "snap_wall_s": med(s[0] for s in snap),
            "plain_cpu_s": med(p[1] for p in plain), "snap_cpu_s": med(s[1] for s in snap),
            "commit_s": med(s[2] for s in snap), "local_state_bytes": local_bytes, "slot_bytes": own,
            "shm_bytes": mapped, "formula_bytes": formula, "restore_s": restore_s, "restored_step": restored,
            "restored_bitwise": same}


def _locals(model, opt):
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        yield p.to_local() if isinstance(p, DTensor) else p
    for st in opt.state.values():
        for v in st.values():
            if hasattr(v, "numel"):
                yield v.to_local() if isinstance(v, DTensor) else v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="27m")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--replica", default="auto", choices=("auto", "always", "off"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        pipes, procs = [], []
        for r in range(args.nproc):
            here, there = ctx.Pipe()
            p = ctx.Process(target=_rank, args=(r, args.nproc, os.path.join(tmp, "store"), shm, args.size,
                                                args.rounds, args.steps, args.replica, there))
            p.start()
            pipes.append(here)
            procs.append(p)
        results = [c.recv() for c in pipes]
        for p in procs:
            p.join()
    r0 = results[0]
    out = {"load_average": os.getloadavg(),
           "size": args.size, "nproc": args.nproc, "rounds": args.rounds, "steps": args.steps,
           "replica": args.replica, "ranks": results,
           "wall_ratio": r0["snap_wall_s"] / r0["plain_wall_s"],
           "cpu_ratio": r0["snap_cpu_s"] / r0["plain_cpu_s"],
           "shm_over_formula": [r["shm_bytes"] / r["formula_bytes"] for r in results]}
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
