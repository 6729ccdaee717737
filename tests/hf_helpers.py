"""Helpers of the Hugging Face test files (``test_huggingface.py``, ``test_hf_trainer.py``,
``test_hf_accelerate.py``): the tiny random Llama, the token dataset, what a launcher sets, the refusal of a
route that would wrap a sharded model in DDP. ``transformers`` is imported inside the functions only."""

from __future__ import annotations

import os

import torch


def make_llama():
    """A tiny random ``LlamaForCausalLM`` (no hub): 33 vocabulary rows and 25 MLP rows split unevenly over 2
    ranks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=33, hidden_size=16, intermediate_size=25, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=False, attn_implementation="eager")
    return LlamaForCausalLM(cfg)


def sharded_llama():
    """``make_llama()`` sharded as docs/huggingface.md does it: each decoder layer, then the root."""
    from perparam import fully_shard

    model = make_llama()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


class Tokens(torch.utils.data.Dataset):
    """``n`` sequences of 7 random ids (seeded): every label counts, so each micro-batch has the same
    tokens."""

    def __init__(self, n: int, seed: int):
        self.ids = torch.randint(0, 33, (n, 7), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def launched(rank: int, world: int) -> None:
    """What torchrun sets, which transformers and accelerate read to see a distributed run (the harness has
    initialised the process group already; they use it). ``world == 0`` (one process's reference): nothing."""
    if world:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")


def ddp_refusal(wrap) -> str | None:
    """The ``ShardingError`` message of ``wrap(model)`` on a freshly sharded Llama (``None`` if it ran)."""
    from perparam import ShardingError

    try:
        wrap(sharded_llama())
    except ShardingError as e:
        return str(e)
    return None
