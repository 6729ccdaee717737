"""A compact LLaMA decoder (the architecture of SmolLM2), written for reading, with no parallel code in it.

Shapes use ``batch`` (B), ``seq`` (T), ``dim`` (D, the model width), ``heads`` (H query heads), ``kv_heads``
(G key/value heads shared by ``H / G`` query heads each) and ``head_dim`` (``D / H``).

Tensor parallelism is applied from outside (``parallelize_module`` on the projections): attention reads the
number of heads from the q/k/v projections' outputs (``view(b, t, -1, head_dim)``), so a projection that
holds only this rank's heads works unchanged. In low-precision compute (bf16 parameters), RMSNorm
normalises in fp32 and :func:`next_token_loss` takes the cross-entropy in fp32.

Parameters only (no buffers): the rotary angles are recomputed in every forward from the sequence length,
so a model built on the meta device works after ``model.to_empty(device=...)`` plus ``reset_parameters()``
(or ``load_state_dict(..., assign=True)``), and sharding the parameters leaves nothing replicated behind.

With ``tie_embeddings`` (SmolLM2) the output projection is the token embedding: logits are
``h @ embed.weight.T``. The tie is made by using the one parameter in both places, not by two modules sharing
a weight, so a wrapper that replaces parameters module by module (as ``perparam.fully_shard`` does) cannot
untie it by accident. Untied models get their own ``lm_head`` Linear.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a LLaMA decoder. Defaults are SmolLM2-135M."""

    vocab_size: int = 49152
    dim: int = 576
    n_layers: int = 30
    n_heads: int = 9
    n_kv_heads: int = 3
    ffn_dim: int = 1536
    max_seq_len: int = 8192
    rope_theta: float = 100000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def smollm2_135m(cls) -> LlamaConfig:
        return cls()

    @classmethod
    def tiny(cls) -> LlamaConfig:
        """2 layers, width 64, 4 query heads over 2 key/value heads, a byte-sized vocabulary (256)."""
        return cls(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=1024,
                   rope_theta=10000.0)

    def num_params(self) -> int:
        """Parameter count (the tied output projection counted once)."""
        d, hd = self.dim, self.head_dim
        attn = d * self.n_heads * hd + 2 * d * self.n_kv_heads * hd + self.n_heads * hd * d
        mlp = 3 * d * self.ffn_dim
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.n_layers * (attn + mlp + 2 * d) + d + head


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last dim; computed in fp32, returned in x's dtype."""

    def __init__(self, dim: int, eps: float, device: torch.device | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., dim]
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)  # the scale in fp32 too (bf16 compute)


def rotary_cos_sin(seq_len: int, head_dim: int, theta: float, device: torch.device,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines of the rotary angles, each ``[seq, head_dim]``.

    Position ``t`` rotates the pair of channels ``(i, i + head_dim/2)`` by angle ``t * theta**(-2i/head_dim)``
    (the "rotate half" layout; the GGUF loader un-permutes llama.cpp's interleaved q/k rows to match it).
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)  # [seq, hd/2]
    angles = torch.cat([angles, angles], dim=-1)  # [seq, head_dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[batch, heads, seq, head_dim]`` by the angles in ``cos``/``sin`` ``[seq, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # [batch, heads, seq, head_dim]
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary position embeddings, no biases."""

    def __init__(self, cfg: LlamaConfig, device: torch.device | None = None) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False, device=device)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False, device=device)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False, device=device)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` ``[batch, seq, dim]`` -> ``[batch, seq, dim]``."""
        b, t, _ = x.shape
        # -1 heads: the projections may hold only some of the heads (a tensor-parallel split of their rows)
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # [b, heads, seq, hd]
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # [b, kv, seq, hd]
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # [b, kv, seq, hd]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        group = q.shape[1] // k.shape[1]  # query heads per kv head, from the heads actually here
        k = k.repeat_interleave(group, dim=1)  # [b, heads, seq, hd]: query head h reads kv head h // group
        v = v.repeat_interleave(group, dim=1)  # [b, heads, seq, hd]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads, seq, hd]
        out = out.transpose(1, 2).reshape(b, t, -1)  # [b, seq, heads * hd]
        return self.o_proj(out)


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: LlamaConfig, device: torch.device | None = None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False, device=device)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False, device=device)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, seq, dim] -> [b, seq, ffn_dim] -> [b, seq, dim]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: LlamaConfig, device: torch.device | None = None) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, device=device)
        self.attn = Attention(cfg, device=device)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps, device=device)
        self.mlp = MLP(cfg, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` ``[batch, seq, dim]``; ``cos``/``sin`` ``[seq, head_dim]``."""
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Token ids ``[batch, seq]`` -> next-token logits ``[batch, seq, vocab]``.

    Submodules: ``embed`` (token embedding, also the output projection when tied), ``layers`` (a ModuleList
    of :class:`DecoderLayer`, the unit to shard one by one), ``norm`` (the final RMSNorm) and, for untied
    configs only, ``lm_head``.
    """

    def __init__(self, cfg: LlamaConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, device=device) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, device=device)
        self.lm_head = (None if cfg.tie_embeddings
                        else nn.Linear(cfg.dim, cfg.vocab_size, bias=False, device=device))
        self.reset_parameters()

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The output projection ``[vocab, dim]``: the embedding matrix itself when tied."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Random init: normal(0, init_std) for matrices, the residual outputs scaled by 1/sqrt(2 n_layers);
        ones for norms. Works on any device, and is a no-op on meta tensors."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        nn.init.normal_(self.embed.weight, mean=0.0, std=std)
        for layer in self.layers:
            for lin in (layer.attn.q_proj, layer.attn.k_proj, layer.attn.v_proj, layer.mlp.gate_proj,
                        layer.mlp.up_proj):
                nn.init.normal_(lin.weight, mean=0.0, std=std)
            nn.init.normal_(layer.attn.o_proj.weight, mean=0.0, std=out_std)
            nn.init.normal_(layer.mlp.down_proj.weight, mean=0.0, std=out_std)
            layer.attn_norm.reset_parameters()
            layer.mlp_norm.reset_parameters()
        self.norm.reset_parameters()
        if self.lm_head is not None:
            nn.init.normal_(self.lm_head.weight, mean=0.0, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` ``[batch, seq]`` (int64) -> logits ``[batch, seq, vocab]``."""
        seq = tokens.shape[1]
        if seq > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {seq} tokens is longer than the context of {self.cfg.max_seq_len}")
        x = self.embed(tokens)  # [batch, seq, dim]
        cos, sin = rotary_cos_sin(seq, self.cfg.head_dim, self.cfg.rope_theta, x.device, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)  # [batch, seq, dim]
        x = self.norm(x)
        return F.linear(x, self.lm_head_weight)  # [batch, seq, vocab]


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy in nats of ``logits`` ``[batch, seq, vocab]`` against ``targets`` ``[batch, seq]``.

    ``reduction="mean"`` averages over all tokens, ``"sum"`` adds them (for exact averages across ranks).
    """
    flat_logits = logits.flatten(0, 1).float()  # [batch * seq, vocab]
    return F.cross_entropy(flat_logits, targets.flatten(), reduction=reduction)  # targets: [batch * seq]
