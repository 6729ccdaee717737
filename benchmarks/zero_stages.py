"""Per-rank model state and bytes sent per step of each ZeRO stage (``ParamPolicy(zero_stage=...)``),
measured on gloo ranks, side by side with the formulas of ``perparam.memory.formulas`` (Table 7-2).

    python -m benchmarks.zero_stages [--world 2] [--quick]

Configurations: all-stage-1, all-stage-2, all-stage-3 and a mix (embeddings and norms stage 1, attention
stage 2, MLP and head stage 3), wrapped as ``benchmarks/configs.py`` wraps perparam, AdamW, fp32. Per
rank after a step's backward: live bytes of parameters (shards plus stage-1/2 kept copies), gradients and
AdamW state (``perparam.memory.measure.model_state_bytes``). Per step (the second): bytes this rank sends,
from ``perparam.CommCounter``'s records: an all-gather or reduce-scatter of ``n`` bytes (its gathered
output, its input) sends ``(K - 1) / K * n``, a ring all-reduce of ``n`` bytes ``2 (K - 1) / K * n``.
Formulas (ZeRO paper, Section 7): DDP, ZeRO-1/2 ``2 (K - 1) / K * G``; ZeRO-3 ``(K - 1) / K * (G + 2P)``.
"""

from __future__ import annotations

import argparse
import json
from fractions import Fraction

import torch
from torch import nn

CONFIGS = ("stage1", "stage2", "stage3", "mix")


def _policy(name: str, model: nn.Module):
    """A call-wide ``ParamPolicy`` for ``stageN``; ``mix``: by the parameter's module (embeddings and norms
    stage 1, attention's ``qkv``/``proj`` stage 2, the rest stage 3)."""
    from perparam import ParamPolicy

    if name != "mix":
        return ParamPolicy(zero_stage=int(name[-1]))
    stage = {}
    for module_name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            if isinstance(module, (nn.Embedding, nn.LayerNorm)):
                stage[id(p)] = 1
            elif module_name.rsplit(".", 1)[-1] in ("qkv", "proj"):
                stage[id(p)] = 2
    return lambda _name, p: ParamPolicy(zero_stage=stage.get(id(p), 3))


def measure_rank(rank: int, world: int, opts: dict) -> dict:
    """One configuration on this rank: state bytes after the second step's backward, bytes sent in it."""
    from torch.distributed.device_mesh import init_device_mesh

    import perparam
    from benchmarks.configs import seeded_full_init, wrap_units
    from benchmarks.model import GPTConfig, make_batches
    from benchmarks.runner import local_batch
    from perparam.memory.measure import model_state_bytes

    cfg = GPTConfig(**opts["model"])
    mesh = init_device_mesh("cpu", (world,))
    model = seeded_full_init(cfg, opts["seed"])
    policy = _policy(opts["config"], model)
    for modules, raf in wrap_units(model):
        perparam.fully_shard(modules if len(modules) > 1 else modules[0], mesh=mesh, reshard_after_forward=raf,
                             param_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = make_batches(cfg, 2, opts["batch_per_rank"] * world, seed=opts["seed"])
    sent, state = Fraction(0), None
    for i, batch in enumerate(batches):
        x, y = local_batch(batch, rank, world)
        with perparam.CommCounter() as comm:
            model(x, y).backward()  # the mean next-token cross-entropy
            state = model_state_bytes(model, opt).as_dict()  # gradients alive, AdamW state from step 1
            opt.step()
            opt.zero_grad()
        if i == len(batches) - 1:
            k = Fraction(world - 1, world)
            sent = sum(r.nbytes * k * (2 if r.kind == "all_reduce" else 1) for r in comm.records)
            kinds = comm.by_kind()
    return {"state": state, "sent": float(sent), "kinds": kinds}


def _formulas(model: nn.Module, world: int) -> dict:
    from perparam.memory.formulas import BytesPerParam, stage_memory

    n = sum(p.numel() for p in model.parameters())
    bpp = BytesPerParam(params=4, grads=4, optimizer=8)  # fp32, AdamW's two moments
    k = Fraction(world - 1, world)
    p = g = 4 * n
    out = {f"stage{s}": stage_memory(f"ZeRO-{s}", n, world, bpp).as_dict() for s in (1, 2, 3)}
    out["sent"] = {"DDP/ZeRO-1/2": float(2 * k * g), "ZeRO-3": float(k * (g + 2 * p))}
    return out


def main(argv: list[str] | None = None) -> dict:
    from benchmarks.configs import seeded_full_init
    from benchmarks.launch import launch
    from benchmarks.model import GPTConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="the quick model (seconds)")
    args = parser.parse_args(argv)
    cfg = GPTConfig.quick() if args.quick else GPTConfig(vocab=2048, seq=64, width=256, layers=4, heads=4)
    result = {"world": args.world, "model": cfg.as_dict(),
              "formulas": _formulas(seeded_full_init(cfg, 0), args.world), "measured": {}}
    for name in CONFIGS:
        opts = {"model": cfg.as_dict(), "config": name, "seed": 0, "batch_per_rank": 2, "timeout": 600}
        per_rank = launch("zero_stages", opts, args.world)
        result["measured"][name] = per_rank[0]  # rank 0 holds the most (torch.chunk's remainder rows)
    print(json.dumps(result, indent=1, default=str))
    return result


if __name__ == "__main__":
    main()
