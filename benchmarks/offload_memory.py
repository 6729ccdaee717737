"""Resident anonymous memory with the disk tier: does RssAnon fall by the planned offloaded bytes?

A random GPT (``benchmarks.harness.model``; default about 352M parameters: width 1024, 24 blocks, vocabulary
24576, context 64), fp32, AdamW, K = ``--world`` ranks (gloo, one thread each), one ``fully_shard`` per
block and one at the root, 1 x ``--seq`` tokens per rank. Per configuration (fresh processes each: no
offload; optimizer state on disk; everything on disk) each rank runs 2 steps and reads ``RssAnon``
(``/proc/self/status``, bytes) in the training phase:

* A: after step 1's optimizer step (I/O flushed, glibc's free blocks given back; the gradients still
  there): planned fall = the bytes of the tier on this rank (``perparam.memory.plan.plan_module``: 2
  AdamW moments; "all": plus the stored shard and its gradient).
* B: during step 2's backward, at the middle block's backward: planned fall = optimizer state (+ shard
  + the gradients reduced so far, counted on the live ``.grad``s, with "all").
* the peak over step 2 (forward, backward, step), sampled every 5 ms on a thread.

glibc maps every allocation of 1 MiB or more on its own (``memory.set_mmap_threshold``), so freed tensors
leave the resident set at once in every configuration. Prints a table (MB = 10**6 bytes) and writes
``--json``.

    python -m benchmarks.offload_memory --dir /tmp --json offload_memory.json
    python -m benchmarks.offload_memory --layers 2 --width 128 --vocab 512   # a smoke run
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import threading
import time
from pathlib import Path

CONFIGS = ("device", "optimizer", "all")


def rss_anon() -> int:
    """This process's ``RssAnon``, bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (not Linux?)")


class AnonPeak:
    """The peak ``RssAnon`` while active, read every ``interval`` seconds on a thread."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval, self.peak = interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(self.interval)

    def __enter__(self) -> AnonPeak:
        self.peak = rss_anon()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())


def rank_job(rank: int, world: int, port: int, config: str, args: dict, out) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.harness import memory
    from benchmarks.harness.model import GPT, GPTConfig, make_batches

    memory.set_mmap_threshold(1 << 20)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import perparam
        from perparam import OffloadPolicy, fully_shard
        from perparam.memory.plan import plan_module

        cfg = GPTConfig(vocab=args["vocab"], seq=args["seq"], width=args["width"], layers=args["layers"],
                        heads=args["heads"])
        with torch.device("meta"):
            plan = plan_module(GPT(cfg), world, dtype=torch.float32, optim_bytes=8).rank(rank)
        torch.manual_seed(0)
        model = GPT(cfg)
        n_params = sum(p.numel() for p in model.parameters())
        mesh = init_device_mesh("cpu", (world,))
        offload = None if config == "device" else OffloadPolicy("disk", config, path=args["dir"])
        for block in model.blocks:
            fully_shard(block, mesh=mesh, offload_policy=offload)
        fully_shard(model, mesh=mesh, offload_policy=offload)
        sharded = list(model.parameters())  # DTensors (between iterations the model holds its shards)
        opt = torch.optim.AdamW(sharded, lr=1e-4)
        planned_a = plan.optimizer + (plan.params + plan.grads if config == "all" else 0)
        probe: dict = {}

        def at_middle(*_):
            grads = sum(p.grad.to_local().numel() * p.grad.element_size()
                        for p in sharded if p.grad is not None)
            probe.update(rss=rss_anon(), grads=grads)

        model.blocks[len(model.blocks) // 2].register_full_backward_pre_hook(at_middle)
        (x, y), = make_batches(cfg, 1, world, seed=1)
        x, y = x[rank:rank + 1], y[rank:rank + 1]
        memory.trim()
        t0 = time.perf_counter()
        model(x, y).backward()
        opt.step()
        perparam.offload.flush()
        memory.trim()
        after_step = rss_anon()
        opt.zero_grad()
        probe.clear()
        with AnonPeak() as peak:
            model(x, y).backward()
            opt.step()
            perparam.offload.flush()
        opt.zero_grad()
        seconds = time.perf_counter() - t0
        planned_b = plan.optimizer + (plan.params + probe["grads"] if config == "all" else 0)
        out.put((rank, {"config": config, "params": n_params, "model_state": plan.total,
                        "rss_after_step1": after_step, "planned_a": planned_a,
                        "rss_mid_backward2": probe["rss"],
                        "planned_b": planned_b if config != "device" else 0, "peak_step2": peak.peak,
                        "tier_bytes": perparam.offload.offloaded_bytes().get("disk", 0), "seconds": seconds}))
    finally:
        dist.destroy_process_group()


def run_config(config: str, args: dict, world: int, port: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_job, args=(r, world, port, config, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + args["timeout"]
    while len(results) < world and time.monotonic() < deadline:
        try:
            rank, rec = out.get(timeout=1.0)
            results[rank] = rec
        except Exception:  # queue.Empty
            if any(p.exitcode not in (None, 0) for p in procs):
                break
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    if len(results) < world:
        raise RuntimeError(f"{config}: {world - len(results)} ranks gave no result (exit codes "
                           f"{[p.exitcode for p in procs]})")
    return [results[r] for r in range(world)]


def main() -> None:
    from benchmarks.harness.launch import disk_tier_parser
    from benchmarks.harness.ports import free_port

    parser = disk_tier_parser(__doc__, world=2, width=1024, layers=24, heads=16, vocab=24576, seq=64)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--timeout", type=float, default=1200.0)
    parser.add_argument("--port", type=int, default=None,
                        help="the first config's port (default: a free one each)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    opts = vars(args)
    rows = {}
    for i, config in enumerate(args.configs.split(",")):
        rows[config] = run_config(config, opts, args.world,
                                  free_port() if args.port is None else args.port + i)
    first = next(iter(rows.values()))[0]
    print(f"GPT {first['params']:,} parameters, fp32 AdamW, K = {args.world}: model state "
          f"{first['model_state'] / 1e6:.1f} MB per rank; 1 x {args.seq} tokens per rank; RssAnon in MB")
    base = rows.get("device")
    print("config     rank  after step 1  fall (planned, ratio)      mid backward 2  fall (planned, ratio)"
          "      peak step 2  tier files  s")
    for config, per_rank in rows.items():
        for r, rec in enumerate(per_rank):
            line = f"{config:<10} {r:>4}  {rec['rss_after_step1'] / 1e6:12.1f}"
            if base and config != "device":
                fa = base[r]["rss_after_step1"] - rec["rss_after_step1"]
                fb = base[r]["rss_mid_backward2"] - rec["rss_mid_backward2"]
                rec["fall_a"], rec["fall_b"] = fa, fb
                rec["ratio_a"], rec["ratio_b"] = fa / rec["planned_a"], fb / rec["planned_b"]
                line += f"  {fa / 1e6:7.1f} ({rec['planned_a'] / 1e6:7.1f}, {rec['ratio_a']:.3f})"
                line += f"  {rec['rss_mid_backward2'] / 1e6:14.1f}"
                line += f"  {fb / 1e6:7.1f} ({rec['planned_b'] / 1e6:7.1f}, {rec['ratio_b']:.3f})"
            else:
                line += f"  {'':>26}  {rec['rss_mid_backward2'] / 1e6:14.1f}  {'':>26}"
            line += (f"  {rec['peak_step2'] / 1e6:11.1f}  {rec['tier_bytes'] / 1e6:10.1f}  "
                     f"{rec['seconds']:.0f}")
            print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": opts, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
