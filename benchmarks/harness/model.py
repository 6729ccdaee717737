"""A small GPT-style decoder for the benchmarks: plain PyTorch, no parallel code.

``GPT(GPTConfig())`` has about 27M parameters (width 512, 6 blocks, vocab 8192, context 128, untied
head). ``GPTConfig.quick()`` is a toy of the same shape for smoke tests. ``SIZES`` names the sizes
``benchmarks/scaling.py`` runs: the same vocabulary, context and head width (64), wider and deeper.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 8192
    seq: int = 128  # context length
    width: int = 512
    layers: int = 6
    heads: int = 8
    mlp_ratio: int = 4

    @classmethod
    def quick(cls) -> GPTConfig:
        return cls(vocab=256, seq=16, width=64, layers=2, heads=4)

    def as_dict(self) -> dict:
        return asdict(self)


#: The model sizes of ``benchmarks/scaling.py`` by name; the name is the parameter count rounded (``"quick"``:
#: the toy). 27.4M, 111.9M (GPT-2 small's width, 14 blocks) and 344.4M (GPT-2 medium's width, 26 blocks).
SIZES = {
    "quick": GPTConfig.quick(),
    "27m": GPTConfig(),
    "110m": GPTConfig(width=768, layers=14, heads=12),
    "350m": GPTConfig(width=1024, layers=26, heads=16),
}


def sized(name: str) -> GPTConfig:
    """The ``GPTConfig`` of size ``name`` (a key of ``SIZES``, case-insensitive); ``ValueError`` naming the
    known sizes otherwise."""
    try:
        return SIZES[name.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown model size {name!r}; choose from {','.join(SIZES)}") from None


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a GELU MLP, each with a residual."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.width
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, cfg.mlp_ratio * d)
        self.out = nn.Linear(cfg.mlp_ratio * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [batch, tokens, width]
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [batch, heads, tokens, head_dim]
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token + position embeddings -> ``layers`` blocks -> final norm -> vocabulary head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Embedding(cfg.seq, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy; ``idx`` and ``targets`` are ``[batch, tokens]`` token ids."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def count_params(cfg: GPTConfig) -> int:
    """``num_params(GPT(cfg))`` without allocating: the model is built on the meta device."""
    with torch.device("meta"):
        return num_params(GPT(cfg))


def make_batches(cfg: GPTConfig, n: int, global_batch: int,
                 seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` random ``(idx, targets)`` global batches (targets are idx shifted by one token)."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        tokens = torch.randint(0, cfg.vocab, (global_batch, cfg.seq + 1), generator=g)
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return batches
