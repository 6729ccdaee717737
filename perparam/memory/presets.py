"""Model presets for ``perparam plan``: a compact GPT-2 and its published sizes.

The model is a plain pre-LayerNorm decoder (token and position embeddings, ``n_layer`` blocks of causal
self-attention and a 4x GELU MLP, a final LayerNorm, an output projection tied to the token embedding),
shaped like OpenAI's GPT-2 (Radford et al., "Language Models are Unsupervised Multitask Learners", 2019).
It holds no parallel code; ``perparam plan`` builds it on the meta device and only reads parameter shapes.

Linear weights use ``nn.Linear``'s ``(out_features, in_features)`` layout, so the parameter count equals
GPT-2's (e.g. 1,557,611,200 for GPT-2 XL) while some shapes are the transpose of the original checkpoint's
``Conv1D`` weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPT2Config:
    """Shape of a GPT-2 model: vocabulary, context length, depth, width and heads."""

    vocab_size: int = 50257
    context: int = 1024
    n_layer: int = 12
    d_model: int = 768
    n_head: int = 12
    mlp_ratio: int = 4
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_head {self.n_head}")

    def num_params(self) -> int:
        """Parameter count with tied embeddings counted once (closed form, matches ``GPT2``)."""
        d, h = self.d_model, self.mlp_ratio * self.d_model
        per_block = (
            2 * d  # ln_1
            + d * 3 * d + 3 * d  # attn.c_attn
            + d * d + d  # attn.c_proj
            + 2 * d  # ln_2
            + d * h + h  # mlp.c_fc
            + h * d + d  # mlp.c_proj
        )
        embeddings = self.vocab_size * d + self.context * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return embeddings + self.n_layer * per_block + 2 * d + head


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.c_proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """GPT-2 decoder: ``forward(tokens[B, T]) -> logits[B, T, vocab_size]``."""

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2's scheme: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer), zero biases.
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() < 2:
                nn.init.ones_(p)
            else:
                std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.cfg.context:
            raise ValueError(f"sequence of {t} tokens is longer than the context {self.cfg.context}")
        pos = torch.arange(t, device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


@dataclass(frozen=True)
class Preset:
    """A named model factory. ``nominal_params``: the round count a text quotes for it, if any."""

    name: str
    factory: Callable[[], nn.Module]
    description: str
    nominal_params: int | None = None
    #: ``parallelize_module``'s plan for ``perparam plan --tp`` (``perparam.memory.tp_plan``)
    tp_plan: Callable[[], dict] | None = None


GPT2_CONFIGS = {
    "gpt2": GPT2Config(n_layer=12, d_model=768, n_head=12),
    "gpt2-medium": GPT2Config(n_layer=24, d_model=1024, n_head=16),
    "gpt2-large": GPT2Config(n_layer=36, d_model=1280, n_head=20),
    "gpt2-xl": GPT2Config(n_layer=48, d_model=1600, n_head=25),
    "gpt2-tiny": GPT2Config(vocab_size=1000, context=128, n_layer=2, d_model=64, n_head=4),
}


def gpt2(name: str = "gpt2") -> GPT2:
    """A GPT-2 of one of the ``GPT2_CONFIGS`` sizes, on the current default device."""
    return GPT2(GPT2_CONFIGS[name])


def gpt2_xl() -> GPT2:
    """GPT-2 XL: 48 layers, width 1600, 25 heads, vocab 50257, context 1024, tied; 1,557,611,200 params."""
    return gpt2("gpt2-xl")


def gpt2_tiny() -> GPT2:
    """A 2-layer, width-64 GPT-2 for tests (vocab 1000, context 128)."""
    return gpt2("gpt2-tiny")


def _preset(name: str, nominal: int | None = None) -> Preset:
    cfg = GPT2_CONFIGS[name]
    desc = (f"GPT-2 {cfg.n_layer} layers, width {cfg.d_model}, {cfg.n_head} heads, vocab {cfg.vocab_size}, "
            f"context {cfg.context}, tied embeddings")
    from perparam.memory.tp_plan import gpt2_tp_plan

    return Preset(name, lambda: gpt2(name), desc, nominal, gpt2_tp_plan)


#: Presets by name. GPT-2 XL's nominal 1.5e9 is the "1.5B parameter, GPT-2 sized" model of the ZeRO tables.
PRESETS: dict[str, Preset] = {
    "gpt2": _preset("gpt2"),
    "gpt2-medium": _preset("gpt2-medium"),
    "gpt2-large": _preset("gpt2-large"),
    "gpt2-xl": _preset("gpt2-xl", nominal=1_500_000_000),
    "gpt2-tiny": _preset("gpt2-tiny"),
}
