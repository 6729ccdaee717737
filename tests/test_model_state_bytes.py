"""Per-rank bytes of parameters, gradients and AdamW state equal the layout's figures (about 1/K)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import perparam
from perparam.memory.measure import model_state_bytes
from perparam.sharding.layout import ShardLayout
from tests.distributed import run_distributed
from tests.models import TinyNet, local_slice, make_batches


def measure_after_step(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = TinyNet(d=16, n_blocks=2)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    full_bytes = sum(p.numel() * 4 for p in model.parameters())
    groups = [[f"blocks.{i}.{n}" for n, _ in block.named_parameters()]
              for i, block in enumerate(model.blocks)]
    for block in model.blocks:
        perparam.fully_shard(block)
    perparam.fully_shard(model)
    groups.append([n for n in shapes if not n.startswith("blocks.")])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = (local_slice(t, rank, world_size) for t in make_batches(1, 8)[0])
    F.mse_loss(model(x), y).backward()
    opt.step()
    measured = model_state_bytes(model, opt)
    return {"measured": measured.as_dict(), "shapes": shapes, "groups": groups, "full": full_bytes}


def test_bytes_per_rank_equal_the_layout():
    world_size = 3
    results = run_distributed(measure_after_step, world_size)
    for rank, out in enumerate(results):
        layouts = {n: ShardLayout(s, torch.float32, world_size) for n, s in out["shapes"].items()}
        params = sum(lay.local_bytes(rank) for lay in layouts.values())
        # gradients are views of one reduce-scatter output per group: padded shards, counted once, and
        # the output's tail of used flags (one fp32 per parameter of the group)
        grads = sum((layouts[n].padded_local_numel + 1) * 4 for names in out["groups"] for n in names)
        # AdamW: exp_avg and exp_avg_sq shaped like the local shard, plus a 4-byte fp32 step per parameter
        optimizer = sum(2 * lay.local_bytes(rank) + 4 for lay in layouts.values())
        assert out["measured"] == {"params": params, "grads": grads, "optimizer": optimizer,
                                   "total": params + grads + optimizer}
        # at most ceil(rows / K) rows of every parameter: about 1/K of the unsharded bytes
        assert params <= sum(lay.padded_local_numel * 4 for lay in layouts.values())
    # the shards partition the model: no byte held twice, none lost
    assert sum(out["measured"]["params"] for out in results) == results[0]["full"]
