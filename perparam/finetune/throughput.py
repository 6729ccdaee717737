"""Tokens per second and model FLOPs utilisation (MFU) of ``perparam finetune``.

MFU = (training tokens per second x model FLOPs per token) / (the machine's peak FLOP/s), with the peak
*measured* once at start-up: every rank times a square ``torch.matmul`` at the same time (so ranks that
share cores share them here too) and the ranks' rates are summed.

Model FLOPs per training token follow PaLM (Chowdhery et al. 2022, "PaLM: Scaling Language Modeling with
Pathways", appendix B): ``6 N + 12 L H Q T`` — forward and backward (x3) of the 2 FLOPs per multiply-add of
every weight a token goes through (``N``), plus the attention scores and their weighted sum (``L`` layers,
``H`` query heads, ``Q`` head dim, ``T`` sequence length; the causal mask is not discounted, as in PaLM).
``N`` counts the weights used in a matmul: every Linear and the output projection (with tied embeddings
that is the embedding matrix, counted once; an untied embedding's lookup is not a matmul), not the norms.
Rematerialisation is not counted (model FLOPs, not hardware FLOPs). Under ``--lora``/``--qlora`` the adapters'
weights are matmul weights too, and a frozen weight needs no weight gradient: 4 FLOPs per weight and token
(forward, input gradient) instead of 6, so ``6 N - 2 N_frozen + 12 L H Q T``.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from perparam.finetune.model import LlamaConfig


def matmul_weights(cfg: LlamaConfig) -> int:
    """``N``: the weights a token's forward multiplies with (see the module docstring)."""
    norms = cfg.n_layers * 2 * cfg.dim + cfg.dim
    lookup = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
    return cfg.num_params() - norms - lookup


def flops_per_token(cfg: LlamaConfig, seq_len: int, params_total: int | None = None,
                    trainable: int | None = None) -> int:
    """Training FLOPs per token, ``6 N + 12 L H Q T`` (PaLM, appendix B); ``params_total`` (the model's
    parameters, adapters included) and ``trainable`` (those with ``requires_grad``) count the adapters in
    ``N`` and the frozen weights at 4 FLOPs instead of 6 (see the module docstring)."""
    n = matmul_weights(cfg) + (params_total - cfg.num_params() if params_total is not None else 0)
    frozen = n - min(trainable, n) if trainable is not None else 0
    return 6 * n - 2 * frozen + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len


def measure_matmul_peak(device: torch.device, dtype: torch.dtype = torch.float32,
                        budget_s: float = 0.25) -> float:
    """FLOP/s of the fastest of repeated ``[n, n] @ [n, n]`` products on ``device`` in ``dtype`` (``n`` 1024
    on CPU, 4096 on CUDA), timed for about ``budget_s`` seconds after one warm-up product."""
    n = 4096 if device.type == "cuda" else 1024
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    torch.matmul(a, b)
    sync()
    best, spent = float("inf"), 0.0
    while spent < budget_s:
        start = time.perf_counter()
        torch.matmul(a, b)
        sync()
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
    return 2 * n ** 3 / best


#: a bf16 matmul slower than the same fp32 one is emulated (issue 24: torch on an AVX2 CPU without AVX-512
#: BF16/AMX converted it, 20x slower than fp32); native bf16 (AVX-512 BF16, AMX, tensor cores) is faster than
#: fp32
BF16_EMULATED_ABOVE = 1.0
BF16_PROBE_N = 128  # [128, 128] @ [128, 128]: 4.2 MFLOP, about 1 ms per product where bf16 is emulated


def time_matmul(device: torch.device, dtype: torch.dtype, n: int = BF16_PROBE_N, repeats: int = 3) -> float:
    """Seconds of the fastest of ``repeats`` ``[n, n] @ [n, n]`` products in ``dtype`` (after one warm-up)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    best = float("inf")
    for i in range(repeats + 1):
        start = time.perf_counter()
        torch.matmul(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            best = min(best, time.perf_counter() - start)
    return best


def bf16_slowdown(device: torch.device) -> float:
    """How many times longer a bf16 matmul takes than the same fp32 one (``time_matmul``), from the times
    summed over all ranks (a collective), so every rank gets the same figure and decides alike."""
    times = torch.tensor([time_matmul(device, torch.float32), time_matmul(device, torch.bfloat16)],
                         dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(times)
    return times[1].item() / times[0].item()


def compute_dtype(param_dtype: str, by_default: bool, slowdown: float) -> tuple[str, str | None]:
    """``(the compute dtype to use, the line that says why it changed, or None)``.

    ``param_dtype``: ``"fp32"`` or ``"bf16"``; ``by_default``: it was not given on the command line
    (``--qlora``'s bf16); ``slowdown``: ``bf16_slowdown()``. bf16 chosen by default becomes fp32 where bf16
    is emulated (``slowdown > BF16_EMULATED_ABOVE``); a bf16 the user asked for is kept (with a warning line).
    """
    if param_dtype != "bf16" or slowdown <= BF16_EMULATED_ABOVE:
        return param_dtype, None
    emulated = f"this machine emulates bf16 matmuls ({slowdown:.1f}x slower than fp32)"
    if by_default:
        return ("fp32",
                f"compute in fp32, not --qlora's default bf16: {emulated}; --param-dtype bf16 forces it")
    return "bf16", f"compute in bf16 as asked (--param-dtype bf16), although {emulated}"


def machine_peak(device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """``(per-rank peaks summed over all ranks, this rank's peak)`` in FLOP/s; a collective (every rank
    measures at the same time)."""
    mine = measure_matmul_peak(device, dtype)
    total = torch.tensor([mine], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(total)
    return total.item(), mine


def mfu(tokens_per_s: float, flops: int, peak_flops: float) -> float:
    """Model FLOPs utilisation in [0, 1]: ``tokens_per_s`` x ``flops`` (per token) over ``peak_flops``."""
    return tokens_per_s * flops / peak_flops if peak_flops > 0 else 0.0
