"""Starting the benchmark's ranks: fresh gloo process groups over 127.0.0.1, one thread per rank, forked
from a forkserver that has torch and perparam imported; each rank's result comes back through a pipe.

The A/B scripts (``gather_step.py``, ``reduce_step.py``, ``profile_step.py``) start theirs with
``spawn_ranks`` and ``init_gloo`` and report with ``paired_medians`` / ``paired_rank_line``; the command-line
scripts check their counts with ``check_counts`` and write their JSON with ``write_json``.
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing as mp
import statistics
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.harness.ports import free_port
from benchmarks.harness.runner import JOBS


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
                                     "torch.distributed.tensor", "perparam", "benchmarks.harness.runner"])
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


def ab_parser(doc: str) -> argparse.ArgumentParser:
    """The A/B sweeps' parser (``gather_step.py``, ``reduce_step.py``): described by ``doc``'s first
    paragraph, with ``--rounds``, ``--algorithms`` (comma-separated, the first is the paired baseline),
    ``--config`` and ``--quick``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--algorithms", default="all_to_all,zero_copy")
    ap.add_argument("--config", default="perparam",
                    help="a benchmarks.harness.configs configuration (default perparam)")
    ap.add_argument("--quick", action="store_true", help="the toy model")
    return ap


def spawn_ranks(target, world: int, *args) -> list:
    """Run ``target(rank, world, port, *args, queue)`` in ``world`` spawned processes (``port``: a free TCP
    port for ``init_gloo``, ``benchmarks.harness.ports.free_port``); return what each put on ``queue``, sorted
    (rank first)."""
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted(queue.get() for _ in procs)
    for p in procs:
        p.join()
    return results


def init_gloo(rank: int, world: int, port: int, timeout_s: float = 600.0) -> None:
    """One thread, then this rank's gloo process group over ``tcp://127.0.0.1:port``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


def init_and_build(rank: int, world: int, port: int, config: str, cfg) -> tuple:
    """``init_gloo``, then ``benchmarks.harness.configs.build(config, cfg, <1D cpu mesh of world>, seed 0)``:
    this rank's ``(model, optimizer)``."""
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.harness.configs import build

    init_gloo(rank, world, port)
    return build(config, cfg, init_device_mesh("cpu", (world,)), 0)


def paired_medians(times: dict[str, list[float]]) -> tuple[dict[str, float], dict[str, float]]:
    """Per variant: the median of its times (s), and the median over rounds of (its time / the first
    variant's time in the same round)."""
    first = times[next(iter(times))]
    medians = {a: statistics.median(t) for a, t in times.items()}
    paired = {a: statistics.median(t / f for t, f in zip(ts, first)) for a, ts in times.items()}
    return medians, paired


def paired_rank_line(rank: int, medians: dict[str, float], paired: dict[str, float]) -> str:
    """``rank R: A x.x ms CPU (paired 1.000), B y.y ms CPU (paired 0.9xx)``."""
    return f"rank {rank}: " + ", ".join(f"{a} {medians[a] * 1e3:.1f} ms CPU (paired {paired[a]:.3f})"
                                        for a in medians)


def check_counts(ap: argparse.ArgumentParser, args: argparse.Namespace, flags: tuple[str, ...]) -> None:
    """``ap.error`` (one line, exit 2) naming the flag when one of ``flags`` is below 1 or ``--warmup``
    below 0; ``None`` (the flag's default left to the caller) passes."""
    for flag in flags:
        value = getattr(args, flag)
        if value is not None and value < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1 (got {value})")
    if args.warmup is not None and args.warmup < 0:
        ap.error(f"--warmup must be 0 or more (got {args.warmup})")


def write_json(path: Path | None, result: dict, indent: int = 2) -> None:
    """Write ``result`` to ``path`` (folders made) when a path was given."""
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=indent) + "\n")


def disk_tier_parser(doc: str, **counts: int) -> argparse.ArgumentParser:
    """The offload scripts' parser: described by ``doc``'s first line, ``--dir`` (the disk tier's folder,
    default the temporary folder), then one integer flag per keyword (``--name``, that default), in order."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="folder of the disk tier")
    for name, default in counts.items():
        parser.add_argument(f"--{name}", type=int, default=default)
    return parser
