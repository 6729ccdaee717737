"""What ``perparam.elastic.StepWatchdog`` costs per step when nothing fails: paired rounds of the same steps
without and with it, and the CPU of its heartbeat thread.

    python -m benchmarks.watchdog_step [--nproc 2] [--width 512] [--rounds 6] [--steps 20]

A ``--width``-wide 4-layer MLP sharded over ``--nproc`` gloo ranks (one thread each, batch 32 per rank; the
process group over a ``TCPStore``, as torchrun's). Each round runs ``--steps`` steps without a watchdog and
``--steps`` with one (the order alternating per round); reported per rank: the median step (wall and process
CPU, the heartbeat thread included) of each, their paired ratio (median over rounds of with / without), and
the heartbeat thread's own CPU per step (``time.thread_time`` inside it).
"""

from __future__ import annotations

import argparse
import statistics
import time


def _rank(rank: int, world: int, port: int, width: int, rounds: int, steps: int, queue) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import perparam
    from benchmarks.harness.launch import init_gloo
    from perparam.elastic import StepWatchdog

    init_gloo(rank, world, port)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])
    for layer in model:
        perparam.fully_shard(layer)
    perparam.fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(32, width)

    def run(n: int, watchdog, model=model, optimizer=optimizer) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(n):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            if watchdog is not None:
                watchdog.step()
        return (time.perf_counter() - wall) / n, (time.process_time() - cpu) / n

    run(3, None)  # warm-up
    times = {"without": [], "with": []}
    cpus = {"without": [], "with": []}
    thread_cpu = []
    for r in range(rounds):
        for variant in (("without", "with") if r % 2 == 0 else ("with", "without")):
            dist.barrier()
            watchdog = StepWatchdog() if variant == "with" else None
            wall, cpu = run(steps, watchdog)
            if watchdog is not None:
                watchdog.close()
                thread_cpu.append(watchdog.beat_cpu_s / steps)
            times[variant].append(wall)
            cpus[variant].append(cpu)
    paired = statistics.median(w / o for w, o in zip(times["with"], times["without"]))
    paired_cpu = statistics.median(w / o for w, o in zip(cpus["with"], cpus["without"]))
    queue.put((rank, {k: statistics.median(v) for k, v in times.items()}, paired,
               {k: statistics.median(v) for k, v in cpus.items()}, paired_cpu, statistics.median(thread_cpu)))
    import gc

    del model, optimizer, run
    gc.collect()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    from benchmarks.harness.launch import spawn_ranks

    for rank, wall, paired, cpu, paired_cpu, thread in spawn_ranks(_rank, args.nproc, args.width, args.rounds,
                                                                   args.steps):
        print(f"rank {rank}: step without {wall['without'] * 1e3:.2f} ms, with {wall['with'] * 1e3:.2f} ms "
              f"(paired {paired:.3f}); CPU without {cpu['without'] * 1e3:.2f} ms, with "
              f"{cpu['with'] * 1e3:.2f} ms (paired {paired_cpu:.3f}); heartbeat thread {thread * 1e6:.1f} us "
              "CPU per step")


if __name__ == "__main__":
    main()
