"""LoRA and QLoRA for ``perparam finetune`` (``--lora RANK``, ``--lora-alpha``, ``--lora-targets``,
``--qlora``).

LoRA (Hu et al., 2021) freezes a Linear weight ``W`` ``[out, in]`` and learns a low-rank update: the layer
computes ``y = x W^T + (alpha / r) (x A^T) B^T`` with ``A`` ``[r, in]`` (kaiming-uniform, ``a = sqrt(5)``, as
peft and ``nn.Linear`` initialise) and ``B`` ``[out, r]`` (zeros, so training starts from the base model).
``alpha`` defaults to ``2 * r`` (a scale of 2 whatever the rank, the common rule of thumb; the QLoRA paper's
``r = 8, alpha = 16`` is this rule). Everything else is frozen: embedding (also the tied output head),
RMSNorms and the Linear weights that are not targets; only the adapters get gradients and AdamW state.

QLoRA (Dettmers et al., 2023) also stores the frozen projection weights of every decoder layer (all seven,
targets or not) in NF4 (``QuantPolicy("nf4", store_quantized=True)``: 4-bit codes plus an fp32 absmax per
64, 0.140625x the fp32 bytes), gathered as 4-bit codes and dequantized to bf16. The adapters keep fp32
shards, gradients and AdamW state (master weights) and compute in bf16: ``MixedPrecisionPolicy(param_dtype
=bf16, reduce_dtype=fp32)`` on every call (``--qlora`` makes bf16 the default ``--param-dtype``; where bf16
matmuls are emulated the job computes in fp32 instead: ``job.hardware_compute_dtype``).

Per-parameter sharding is what makes this one group per layer: the frozen base (fp32 or NF4 codes) and the
trainable fp32 adapters of a decoder layer go into the same ``fully_shard`` call, so a layer's unshard is
exactly one all-gather (FSDP2 refuses mixed ``requires_grad`` or dtypes in one group). A
:class:`LoRALinear` keeps the base weight under its ``weight`` name, so the state dict of
:func:`merged_state_dict` has exactly the names of the model without LoRA. Tensor parallelism is not
supported with LoRA (torch's parallel styles take ``nn.Linear`` only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from perparam.finetune.errors import FinetuneInputError

#: ``--lora-targets`` names: the seven projections of a decoder layer, and where they sit in it.
TARGETS = {"q_proj": "attn.q_proj", "k_proj": "attn.k_proj", "v_proj": "attn.v_proj", "o_proj": "attn.o_proj",
           "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj"}
#: The frozen weights QLoRA stores in NF4, named relative to a decoder layer (all seven projections).
QLORA_BASE_WEIGHTS = "*_proj.weight"
NF4_BLOCK = 64  # elements per fp32 absmax (QLoRA's block size)


@dataclass(frozen=True)
class LoraConfig:
    """``rank`` r (> 0), ``alpha`` (the update is scaled by ``alpha / rank``), ``targets`` (keys of
    :data:`TARGETS`), ``qlora``: NF4 base weights and bf16 compute."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = tuple(TARGETS)
    qlora: bool = False

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def parse_targets(spec: str | None) -> tuple[str, ...]:
    """``"q_proj,v_proj"`` -> ``("q_proj", "v_proj")`` (``None`` or ``"all"``: all seven). Raises
    :class:`FinetuneInputError` naming the unknown names and listing the valid ones."""
    if spec is None or spec.strip() == "all":
        return tuple(TARGETS)
    names = tuple(dict.fromkeys(n.strip() for n in spec.split(",") if n.strip()))
    unknown = [n for n in names if n not in TARGETS]
    if unknown or not names:
        raise FinetuneInputError(f"--lora-targets {spec!r}: unknown {unknown or 'empty list'}; pass a comma "
                                 f"list of {', '.join(TARGETS)} (or 'all')")
    return names


def lora_config(rank: int | None, alpha: float | None = None, targets: str | None = None, qlora: bool = False,
                tp: int = 1, quant: str = "none") -> LoraConfig | None:
    """The :class:`LoraConfig` of ``--lora RANK --lora-alpha ALPHA --lora-targets NAMES [--qlora]`` (``None``
    without ``--lora``); one-line :class:`FinetuneInputError` for bad values and conflicts (with ``--tp``
    and ``--quant``)."""
    if rank is None:
        for flag, given in (("--qlora", qlora), ("--lora-alpha", alpha is not None),
                            ("--lora-targets", targets is not None)):
            if given:
                raise FinetuneInputError(f"{flag} needs --lora RANK (the adapters' rank, e.g. --lora 8)")
        return None
    if rank <= 0:
        raise FinetuneInputError(f"--lora {rank} must be a positive rank (e.g. --lora 8)")
    if alpha is not None and not (math.isfinite(alpha) and alpha > 0):
        raise FinetuneInputError(f"--lora-alpha {alpha} must be a positive finite number (default 2 x "
                                 "--lora)")
    if tp > 1:
        raise FinetuneInputError(f"--lora with --tp {tp}: tensor parallelism of LoRA layers is not "
                                 "supported; pass --tp 1 (the adapters are small: shard them over "
                                 "data-parallel ranks)")
    if qlora and quant != "none":
        raise FinetuneInputError(f"--qlora with --quant {quant}: --qlora already stores and gathers the base "
                                 "weights in NF4; drop --quant")
    return LoraConfig(rank, float(2 * rank if alpha is None else alpha), parse_targets(targets), bool(qlora))


def worker_argv(cfg: LoraConfig | None) -> list[str]:
    """The launcher's ``--lora*``/``--qlora`` flags for its workers (none without ``--lora``): ``cfg``, the
    job's ``JobConfig.lora_config()``."""
    if cfg is None:
        return []
    return ["--lora", str(cfg.rank), "--lora-alpha", repr(cfg.alpha), "--lora-targets", ",".join(cfg.targets),
            *(["--qlora"] if cfg.qlora else [])]


def record(cfg: LoraConfig | None) -> dict | None:
    """What a checkpoint (``--save``) and the summary record of the adapters, so ``--resume`` can check it;
    None for full fine-tuning."""
    if cfg is None:
        return None
    return {"rank": cfg.rank, "alpha": cfg.alpha, "targets": list(cfg.targets), "qlora": cfg.qlora}


def check_resume(extra: dict, cfg: LoraConfig | None, resume: str) -> None:
    """One-line :class:`FinetuneInputError` when ``--resume``'s checkpoint (its manifest's ``extra``) was
    trained with other LoRA settings than this run's (a model of other parameters cannot load it).
    Checkpoints written before LoRA existed (no ``lora`` key) were full fine-tuning. ``cfg``: this run's
    (``JobConfig.lora_config()``); ``resume``: the ``--resume`` folder, for the message."""
    saved, now = extra.get("lora"), record(cfg)
    if saved == now:
        return

    def flags(c: dict | None) -> str:
        if c is None:
            return "no --lora (full fine-tuning)"
        return (f"--lora {c['rank']} --lora-alpha {c['alpha']:g} --lora-targets {','.join(c['targets'])}"
                + (" --qlora" if c["qlora"] else ""))

    raise FinetuneInputError(f"--resume {resume}: the checkpoint was trained with {flags(saved)}, this run "
                             f"has {flags(now)}: pass the checkpoint's LoRA flags")


class LoRALinear(nn.Module):
    """``y = x W^T + scaling (x A^T) B^T`` on ``x`` ``[..., in]`` -> ``[..., out]``.

    ``weight`` ``[out, in]``: the (frozen) base Linear's own parameter, under its own name; ``lora_a``
    ``[rank, in]`` and ``lora_b`` ``[out, rank]``: fp32 adapters; ``scaling = alpha / rank``. Computes in
    the dtype its parameters arrive in (one dtype under any of the job's policies).
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        if base.bias is not None:
            raise ValueError("LoRALinear wraps Linear layers without bias (the LLaMA projections)")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        self.weight = base.weight
        device = base.weight.device
        self.lora_a = nn.Parameter(torch.empty(rank, self.in_features, device=device))
        self.lora_b = nn.Parameter(torch.zeros(self.out_features, rank, device=device))
        self.reset_lora_parameters(generator)

    @torch.no_grad()
    def reset_lora_parameters(self, generator: torch.Generator | None = None) -> None:
        """``A``: kaiming-uniform (``a = sqrt(5)``, as peft); ``B``: zeros. No-op on the meta device."""
        if self.lora_a.is_meta:
            return
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5), generator=generator)
        nn.init.zeros_(self.lora_b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scaling

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, alpha={self.alpha:g}"


def apply_lora(model: nn.Module, cfg: LoraConfig, seed: int = 0) -> nn.Module:
    """Replace the target projections of every decoder layer of ``model`` (a ``Llama``) with
    :class:`LoRALinear` and freeze everything but the adapters; in place, before ``fully_shard``.

    ``seed``: the adapters' init (the same on every rank). Returns ``model``.
    """
    generator = torch.Generator().manual_seed(seed)
    model.requires_grad_(False)
    for layer in model.layers:
        for target in cfg.targets:
            parent_name, _, child = TARGETS[target].rpartition(".")
            parent = layer.get_submodule(parent_name)
            lora = LoRALinear(getattr(parent, child), cfg.rank, cfg.alpha, generator=generator)
            setattr(parent, child, lora)
    return model


def layer_policy(cfg: LoraConfig | None) -> dict | None:
    """The decoder layers' ``param_policy`` (names relative to a layer): NF4-stored frozen projection
    weights under QLoRA, ``None`` otherwise."""
    if cfg is None or not cfg.qlora:
        return None
    from perparam import ParamPolicy, QuantPolicy

    nf4 = QuantPolicy("nf4", block_size=NF4_BLOCK, store_quantized=True)
    return {QLORA_BASE_WEIGHTS: ParamPolicy(requires_grad=False, quant=nf4)}


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the optimizer gets: all of them for full fine-tuning, the adapters under LoRA."""
    return [p for p in model.parameters() if p.requires_grad]


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The model with its adapters merged, as plain CPU tensors on rank 0 (``None`` on the others); every
    rank calls it (gathered one tensor at a time by ``perparam.full_state.dequantized_full_state_dict``).

    Each :class:`LoRALinear`'s ``weight`` becomes ``W + (alpha / r) B @ A`` in fp32, ``W`` dequantized
    first when it is stored in NF4; ``lora_a``/``lora_b`` and the NF4 scales (``weight_qscale``) are
    dropped, so the names are exactly the state-dict names of the model without LoRA. Other entries come
    as they are stored. A model without LoRA gives its plain full state dict.
    """
    from perparam.full_state import dequantized_full_state_dict

    full = dequantized_full_state_dict(model)
    if full is None:
        return None
    scaling = {name: m.scaling for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    out: dict[str, torch.Tensor] = {}
    for key, value in full.items():
        prefix, _, leaf = key.rpartition(".")
        if prefix in scaling and leaf in ("lora_a", "lora_b"):
            continue
        if prefix in scaling and leaf == "weight":
            a, b = full[f"{prefix}.lora_a"].float(), full[f"{prefix}.lora_b"].float()
            value = value.float() + scaling[prefix] * (b @ a)  # [out, r] @ [r, in]
        out[key] = value
    return out


def describe(model: nn.Module, cfg: LoraConfig, params_total: int, compute: str = "bf16") -> str:
    """One line for the job's log: rank, alpha, targets, trainable parameters (of ``params_total``, counted
    before sharding) and the frozen base's storage; ``compute``: the compute dtype the job settled on."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    base = f"NF4 (4-bit codes + an fp32 absmax per 64), {compute} compute" if cfg.qlora else "as loaded"
    return (f"{'QLoRA' if cfg.qlora else 'LoRA'}: rank {cfg.rank}, alpha {cfg.alpha:g} (scale "
            f"{cfg.scaling:g}) on {','.join(cfg.targets)}: {trainable:,} trainable parameters (fp32 "
            f"adapters, {100 * trainable / params_total:.2f}% of {params_total:,}); embedding, norms and "
            f"projection weights frozen, stored {base}")
