"""Starting the benchmark's ranks: fresh gloo process groups over 127.0.0.1, one thread per rank, forked
from a forkserver that has torch and perparam imported; each rank's result comes back through a pipe."""

from __future__ import annotations

import io
import multiprocessing as mp
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from benchmarks.runner import JOBS


def _worker(job: str, rank: int, world: int, port: int, opts: dict, conn) -> None:
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=opts["timeout"]))
        result = JOBS[job](rank, world, opts)
        buf = io.BytesIO()
        torch.save(result, buf)
        conn.send(("ok", buf.getvalue()))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.fsdp",
                                     "torch.distributed.tensor", "perparam", "benchmarks.runner"])
    return _CTX


def launch(job: str, opts: dict, world: int) -> list:
    """Run ``JOBS[job]`` on ``world`` fresh gloo ranks; return each rank's result (raises on failure)."""
    return launch_many([(job, opts)], world)[0]


def launch_many(jobs: list[tuple[str, dict]], world: int) -> list[list]:
    """Run several jobs at once, each on its own ``world`` fresh ranks; per job, each rank's result."""
    ctx = _context()
    procs, conns, stores = [], [], []
    for job, opts in jobs:
        store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=60))
        stores.append(store)
        for rank in range(world):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker, args=(job, rank, world, store.port, opts, child), daemon=True)
            p.start()
            child.close()
            procs.append(p)
            conns.append(parent)
    results: dict[int, tuple] = {}
    deadline = time.monotonic() + max(opts["timeout"] for _, opts in jobs)
    try:
        while len(results) < len(procs) and time.monotonic() < deadline:
            for i, conn in enumerate(conns):
                if i in results:
                    continue
                if conn.poll(0.02):
                    try:
                        results[i] = conn.recv()
                    except EOFError:
                        results[i] = ("error", f"exited ({procs[i].exitcode}) without a result")
                elif not procs[i].is_alive() and not conn.poll(0.05):
                    results[i] = ("error", f"died with exit code {procs[i].exitcode}")
            if any(s == "error" for s, _ in results.values()):
                time.sleep(1.0)  # let the peers report their own errors
                for i, conn in enumerate(conns):
                    if i not in results and conn.poll(0):
                        results[i] = conn.recv()
                break
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    failed = []
    for i in range(len(procs)):
        (job, opts), rank = jobs[i // world], i % world
        what = f"{job}{' ' + opts['config'] if 'config' in opts else ''} rank {rank}"
        if i not in results:
            failed.append(f"--- {what}: timed out ---")
        elif results[i][0] == "error":
            failed.append(f"--- {what} ---\n{results[i][1]}")
    if failed:
        raise RuntimeError("benchmark job failed\n" + "\n".join(failed))
    loaded = [torch.load(io.BytesIO(results[i][1]), weights_only=False) for i in range(len(procs))]
    return [loaded[j * world:(j + 1) * world] for j in range(len(jobs))]
