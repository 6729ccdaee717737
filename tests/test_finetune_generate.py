"""``perparam finetune --generate``: sampling from the sharded model gives the same text on 1, 2 and 4 ranks
(2 data-parallel x 2 tensor-parallel) for the same seed, all-gathers each group once per generation (none
per token after the first forward), and leaves the model resharded with its usual behaviour."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from tests.distributed import run_distributed

PROMPT = list(b"ROMEO:")
NEW_TOKENS = 8


def _generate_rank(rank: int, world: int, tp: int, temperature: float) -> dict:
    import perparam
    from perparam.finetune.generate import SamplingConfig, generate
    from perparam.finetune.model import Llama, LlamaConfig
    from perparam.finetune.train import build_meshes, shard_model

    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny())
    shard_model(model, build_meshes(world, 1, tp, "cpu"))
    groups = 1 + len(model.layers)  # one fully_shard call per layer, one on the root
    gathers_after_forward = []
    with perparam.CommCounter() as comm:
        hook = model.register_forward_hook(lambda *_: gathers_after_forward.append(comm.count("all_gather")))
        sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=temperature, top_k=20, seed=3)
        new = generate(model, PROMPT, sampling, torch.device("cpu"))
        hook.remove()
        comm.clear()
        with torch.no_grad():  # resharded, and reshard_after_forward is back on: each forward gathers again
            model(torch.tensor([PROMPT]))
            model(torch.tensor([PROMPT]))
        gathers_later = comm.count("all_gather")
    return {"new": new, "gathers_after_forward": gathers_after_forward, "groups": groups,
            "gathers_later": gathers_later,
            "sharded": all(isinstance(p, DTensor) for p in model.parameters())}


def test_generation_gives_the_same_text_on_1_2_and_4_ranks_gathering_once():
    temperature = 0.8
    runs = {(1, 1): run_distributed(_generate_rank, 1, 1, temperature, timeout=120),
            (2, 1): run_distributed(_generate_rank, 2, 1, temperature, timeout=120),
            (4, 2): run_distributed(_generate_rank, 4, 2, temperature, timeout=120)}
    reference = runs[(1, 1)][0]["new"]
    assert len(reference) == NEW_TOKENS
    for layout, results in runs.items():
        for r in results:
            assert r["new"] == reference, (layout, r["new"], reference)
            # every group all-gathered in the first forward, then no all-gather for the other tokens
            assert (r["gathers_after_forward"] == [r["groups"]]
                    * NEW_TOKENS), (layout, r["gathers_after_forward"])
            assert r["gathers_later"] == 2 * r["groups"] and r["sharded"], layout
