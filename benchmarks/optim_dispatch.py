"""CPU of ``torch.optim.AdamW.step()`` on the benchmark model's half-size shards (K = 2): on DTensor
parameters (what an FSDP2 step runs) against the same update on their local tensors, and on perparam's
sharded parameters (its step hooks: retargeting, the swap to the local shards and back, the step count;
``perparam.runtime.local_step``), and whether the three are bitwise equal.

    python -m benchmarks.optim_dispatch --steps 12

One process, a 1-rank gloo group (the DTensors' local tensors hold the half-size shards, so the dispatch is
a 2-rank step's and the arithmetic too). Prints the median CPU ms per step of each, in rotating order, and
the median over steps of perparam's step less the local one's (its hooks, paired step by step), and the
CPU of perparam's step hooks alone (every step pre- and post-hook the optimizer runs, called without the
update: ``--hook-rounds`` times).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def main(argv: list[str] | None = None) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.optim import optimizer as optim_module  # the step hooks torch runs around a step

    import perparam
    from benchmarks.harness.model import GPT, GPTConfig
    from benchmarks.harness.ports import free_port
    from perparam.runtime.group import group_of

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--foreach", action="store_true", help="AdamW(foreach=True)")
    ap.add_argument("--hook-rounds", type=int, default=200,
                    help="rounds of the step hooks alone (default 200)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    shapes = [tuple(p.shape) for p in GPT(GPTConfig()).parameters()]
    halves = [((s[0] + 1) // 2, *s[1:]) for s in shapes]
    locals_ = [torch.randn(s) for s in halves]
    grads = [torch.randn(s) for s in halves]
    dparams = [nn.Parameter(DTensor.from_local(t.clone(), mesh, [Shard(0)], run_check=False))
               for t in locals_]
    for p, g in zip(dparams, grads):
        p.grad = DTensor.from_local(g.clone(), mesh, [Shard(0)], run_check=False)
    pparams = [nn.Parameter(t.clone()) for t in locals_]
    for p, g in zip(pparams, grads):
        p.grad = g.clone()
    # perparam's: the half-size shapes as whole parameters on the 1-rank mesh (local shard = the half)
    holder = nn.Module()
    for i, t in enumerate(locals_):
        holder.register_parameter(f"p{i}", nn.Parameter(t.clone()))
    perparam.fully_shard(holder, mesh=mesh)
    sparams = list(holder.parameters())
    for sp, g in zip(group_of(holder).params, grads):  # gradients as perparam's reduction leaves them
        sp.accumulate_sharded_grad(g.clone())
    kw = {"lr": 1e-3, "weight_decay": 0.1, "foreach": args.foreach}
    opts = {"dtensor": torch.optim.AdamW(dparams, **kw), "local": torch.optim.AdamW(pparams, **kw),
            "perparam": torch.optim.AdamW(sparams, **kw)}
    names = list(opts)
    cpu: dict[str, list[float]] = {k: [] for k in opts}
    for i in range(args.steps + 1):
        for name in names[i % 3:] + names[:i % 3]:
            c0 = time.process_time()
            opts[name].step()
            if i:
                cpu[name].append(time.process_time() - c0)
    same = all(torch.equal(d.to_local(), p.detach()) and torch.equal(s.to_local(), p.detach())
               for d, p, s in zip(dparams, pparams, sparams))
    hooks = statistics.median(a - b for a, b in zip(cpu["perparam"], cpu["local"]))
    opt = opts["perparam"]
    pre = [*optim_module._global_optimizer_pre_hooks.values(), *opt._optimizer_step_pre_hooks.values()]
    post = [*opt._optimizer_step_post_hooks.values(), *optim_module._global_optimizer_post_hooks.values()]
    c0 = time.process_time()
    for _ in range(args.hook_rounds):
        for hook in pre:
            hook(opt, (), {})
        for hook in post:
            hook(opt, (), {})
    alone = (time.process_time() - c0) / args.hook_rounds
    n = sum(t.numel() for t in locals_)
    print(f"AdamW(foreach={args.foreach}) on {len(halves)} shards, {n / 1e6:.1f}M elements, load "
          f"{os.getloadavg()[0]:.2f}: DTensor {statistics.median(cpu['dtensor']) * 1e3:.1f} ms CPU, local "
          f"tensors {statistics.median(cpu['local']) * 1e3:.1f} ms, perparam "
          f"{statistics.median(cpu['perparam']) * 1e3:.1f} ms (its hooks: {hooks * 1e3:.2f} ms per step, "
          f"paired median); bitwise equal after {args.steps + 1} steps: {same}; the hooks alone ({len(pre)} "
          f"pre, {len(post)} post): {alone * 1e6:.0f} us per step")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
