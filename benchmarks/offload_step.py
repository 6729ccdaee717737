"""Step time with the disk tier, paired against no offload, and how much of the disk I/O is hidden.

One process (K = 1, gloo), a stack of ``--layers`` x ``Linear(--width, --width)`` in fp32 with AdamW: for
each of ``--pairs`` rounds, ``--steps`` timed steps without offload, then with optimizer state on disk,
then with everything on disk (each after one untimed step that makes the files). Prints the median step
time of each and, for the disk runs, the I/O thread's read and write-back seconds per step and the
seconds per step the training thread waited for them (hidden = 1 - waited / (read + write-back)), and the
seconds per step spent issuing all-gathers (``ParamGroup.start_unshard``: packing the shards, where an
evicted shard is read, by a page fault or by waiting for the tier's read-ahead). "disk all, no gather
read-ahead" is "disk all" with ``perparam.configure(gather_read_ahead=0)`` (the shards read by page
faults when the backward all-gathers pack them): the pair gives what the read-ahead behind the backward
prefetch saves.

    python -m benchmarks.offload_step --dir /tmp --layers 8 --width 1024 --steps 5
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

_GATHER = {"s": 0.0}


def _timed_start_unshard():
    """Wrap ``ParamGroup.start_unshard`` to add its seconds to ``_GATHER`` (once per process)."""
    from perparam.runtime.group import ParamGroup

    inner = ParamGroup.start_unshard
    if getattr(inner, "timed", False):
        return

    def start_unshard(self):
        t0 = time.perf_counter()
        try:
            return inner(self)
        finally:
            _GATHER["s"] += time.perf_counter() - t0

    start_unshard.timed = True
    ParamGroup.start_unshard = start_unshard


def run(offload, args, read_ahead: int = 2) -> tuple[list[float], dict]:
    import perparam
    from perparam import fully_shard

    _timed_start_unshard()
    perparam.configure(gather_read_ahead=read_ahead)

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(args.width, args.width) for _ in range(args.layers)))
    for layer in model:
        fully_shard(layer, offload_policy=offload)
    fully_shard(model, offload_policy=offload)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.width)
    times = []
    for step in range(args.steps + 1):
        if step == 1:
            perparam.offload.flush()
            perparam.offload.reset_stats()
            _GATHER["s"] = 0.0
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if step:
            times.append(time.perf_counter() - t0)
    perparam.offload.flush()
    return times, {**perparam.offload.stats(), "gather_s": _GATHER["s"]}


def main() -> None:
    from benchmarks.harness.launch import disk_tier_parser
    from benchmarks.harness.ports import free_port

    parser = disk_tier_parser(__doc__, layers=8, width=1024, batch=256, steps=5, pairs=2)
    parser.add_argument("--only", default="", help="comma-separated variant names to run (default: all)")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    from perparam import OffloadPolicy

    variants = {"device": (None, 2), "disk optimizer": (OffloadPolicy("disk", "optimizer", path=args.dir), 2),
                "disk all without gather read-ahead": (OffloadPolicy("disk", "all", path=args.dir), 0),
                "disk all": (OffloadPolicy("disk", "all", path=args.dir), 2)}
    variants = {k: v for k, v in variants.items() if not args.only or k in args.only.split(",")}
    times: dict[str, list[float]] = {k: [] for k in variants}
    io: dict[str, list[dict]] = {k: [] for k in variants}
    for _ in range(args.pairs):
        for name, (offload, read_ahead) in variants.items():
            t, s = run(offload, args, read_ahead)
            times[name] += t
            io[name].append(s)
    params = args.layers * (args.width * args.width + args.width)
    print(f"{args.layers} x Linear({args.width}, {args.width}): {params:,} fp32 parameters, AdamW state "
          f"{params * 8 / 1e6:.1f} MB; batch {args.batch}; {args.pairs} x {args.steps} steps per variant")
    base = statistics.median(times["device"]) if "device" in times else None
    steps = args.steps * args.pairs
    for name in variants:
        med = statistics.median(times[name])
        gather = sum(s["gather_s"] for s in io[name]) / steps
        line = f"{name:>30}: median step {med * 1e3:8.1f} ms"
        line += f" ({med / base:.3f} x device)" if base else ""
        line += f"; all-gather issue {gather * 1e3:.1f} ms per step"
        if name != "device":
            read = sum(s["fetch_s"] for s in io[name]) / steps
            write = sum(s["evict_s"] for s in io[name]) / steps
            wait = sum(s["wait_s"] for s in io[name]) / steps
            moved = sum(s["bytes_fetched"] + s["bytes_written"] for s in io[name]) / steps
            hidden = 1 - wait / (read + write) if read + write else 1.0
            line += (f"; per step {moved / 1e6:.1f} MB moved, read {read * 1e3:.1f} ms + write-back "
                     f"{write * 1e3:.1f} ms on the I/O thread, waited {wait * 1e3:.1f} ms: {hidden:.0%} "
                     "hidden")
        print(line)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
