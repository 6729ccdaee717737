"""The main job's model sharded over 2 ranks trains exactly like one process on the same global batches.

Tiny random-init LLaMA (2 layers, width 64), 5 AdamW steps. The reference runs in the same process as each
rank (so with the same threads), on the whole global batch, as ``world`` micro-batches with gradient
accumulation of ``loss / world``: mathematically one full-batch step, and the same arithmetic as the
sharded run (each rank's slice, gradients averaged by the reduce-scatter).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from tests.distributed import run_distributed

STEPS, GLOBAL_BATCH, SEQ, TOL = 5, 4, 16, 1e-6


def _parity_rank(rank: int, world: int) -> dict:
    import perparam
    from perparam.finetune.data import BatchStream
    from perparam.finetune.model import Llama, LlamaConfig, next_token_loss
    from perparam.finetune.train import model_state_bytes

    cfg = LlamaConfig.tiny()
    torch.manual_seed(0)
    model = Llama(cfg)
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    rows = torch.randint(0, cfg.vocab_size, (3 * GLOBAL_BATCH, SEQ + 1), generator=gen)  # [12, SEQ + 1]
    stream = BatchStream(rows, GLOBAL_BATCH, seed=0)

    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        perparam.fully_shard(layer, mesh=mesh)
    perparam.fully_shard(model, mesh=mesh)
    sharded = all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)

    losses, ref_losses = [], []
    for step in range(STEPS):
        inputs, targets = stream.rank_batch(step, rank, world)  # [GLOBAL_BATCH / world, SEQ]
        opt.zero_grad(set_to_none=True)
        loss = next_token_loss(model(inputs), targets)
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)

        ref_opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for x, y in zip(*(t.chunk(world) for t in stream.global_batch(step)), strict=True):
            micro = next_token_loss(reference(x), y) / world
            micro.backward()
            total += micro.detach()
        ref_opt.step()
        ref_losses.append(total.item())

    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    ref = dict(reference.named_parameters())
    max_diff = max((full[n] - ref[n]).abs().max().item() for n in ref)
    return {"sharded": sharded, "losses": losses, "ref_losses": ref_losses, "max_param_diff": max_diff,
            "names": sorted(full) == sorted(ref), "bytes": model_state_bytes(model, opt),
            "params_total": sum(p.numel() for p in reference.parameters())}


def test_two_ranks_match_one_process_for_five_adamw_steps():
    results = run_distributed(_parity_rank, 2, timeout=120)
    for r in results:
        assert r["sharded"] and r["names"]
        assert len(r["losses"]) == STEPS
        diffs = [abs(a - b) for a, b in zip(r["losses"], r["ref_losses"], strict=True)]
        assert max(diffs) <= TOL, (r["losses"], r["ref_losses"])
        assert r["max_param_diff"] <= TOL
    assert results[0]["losses"][-1] < results[0]["losses"][0]  # it trained
    # live per-rank bytes: each rank holds about half of P, G and AdamW's 2 states (plus step counters)
    n = results[0]["params_total"]
    total = {k: sum(r["bytes"][k] for r in results) for k in ("params", "grads", "optimizer")}
    assert total["params"] == total["grads"] == 4 * n
    assert 8 * n <= total["optimizer"] <= 8 * n + 4 * 2 * 64
