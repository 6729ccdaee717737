"""Largest rank vs mean of GPT-2 XL (fp16 params) over K shard ranks, Shard(0) vs placement="auto".

HSDP R x K holds the same per rank as 1D K (only the shard axis splits).

    python -m benchmarks.auto_placement_balance
"""
from fractions import Fraction

import torch
from torch import nn
from torch.distributed.tensor import Shard

from perparam import ParamPolicy
from perparam.memory.plan import build_on_meta
from perparam.memory.presets import PRESETS
from perparam.sharding.resolution import resolve_params


def main() -> None:
    m = build_on_meta(PRESETS["gpt2-xl"].factory)
    named = [(n, nn.Parameter(torch.empty(p.shape, dtype=torch.float16, device="meta")))
             for n, p in m.named_parameters()]
    for k in (64, 256, 1024):
        for pol in (None, ParamPolicy(placement="auto")):
            rs = resolve_params(named, None, pol, k)
            per = [0] * k
            for r in rs:
                for i in range(k):
                    per[i] += r.layout.local_bytes(i)
            mean = Fraction(sum(per), k)
            mx = max(per)
            nsh1 = sum(1 for r in rs if r.layout.placement == Shard(1))
            nrep = sum(1 for r in rs if not r.layout.gathered)
            print(f"K={k} {'auto ' if pol else 'Shard0'} max={mx*8/1e9:.6f}GB mean={float(mean)*8/1e9:.6f}GB "
                  f"(x16/2 bytes total) imbalance={float(mx/mean-1)*100:.2f}% shard1={nsh1} "
                  f"replicated={nrep}")


if __name__ == "__main__":
    main()
