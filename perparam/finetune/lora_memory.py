"""The main job's model-state table by fine-tuning mode: full fine-tuning, LoRA and QLoRA per rank side by
side (params, grads, optimizer), planned from the layout for all three and measured for the mode that ran.

Planned figures come from ``perparam.memory.plan.plan_module`` on a meta-device copy of the model (no
storage; the same resolution code ``fully_shard`` runs, NF4 codes and scales included) over the
data-parallel shard axis of ``K`` ranks (an HSDP replica holds what one 1D shard group holds). Bytes of the
largest rank (rank 0: ``torch.chunk`` puts any remainder rows first), with fp32 shards (master weights),
fp32 gradients of the trainable parameters only, and AdamW's two fp32 moments (8 bytes per trainable
element; the step counters and the reduce-scatter padding are not in the plan, they are in the measured
row). The plan needs one layout per parameter, so it applies to runs without tensor parallelism only.

The ZeRO stage (``--zero-stage``, ``ParamPolicy.zero_stage``) is planned as the run applies it (every
parameter, in the run's ``param_dtype``): the mode rows at the stage that ran (QLoRA, which refuses
stages 1 and 2, at stage 3), and the mode that ran at each of stages 1, 2 and 3, beside its measured row.
"""

from __future__ import annotations

import torch
from torch import nn

from perparam.finetune.lora import LoraConfig, apply_lora, layer_policy

MODES = ("full", "lora", "qlora")
ADAMW_STATE_BYTES = 8  # exp_avg and exp_avg_sq, fp32, per trainable element
KEYS = ("params", "grads", "optimizer")


def _stage_policy(policy: dict | None, zero_stage: int) -> dict | None:
    """``policy`` with ``zero_stage`` on every entry plus a catch-all, as ``train.shard_model`` applies it."""
    if zero_stage == 3:
        return policy
    import dataclasses

    from perparam import ParamPolicy

    return {**{k: dataclasses.replace(v, zero_stage=zero_stage) for k, v in (policy or {}).items()},
            "*": ParamPolicy(zero_stage=zero_stage)}


def planned_row(llama_cfg, shard_ranks: int, lora: LoraConfig, mode: str, zero_stage: int = 3,
                param_dtype: torch.dtype = torch.float32) -> dict[str, int]:
    """``{"params", "grads", "optimizer", "total", "trainable", "zero_stage"}`` for rank 0 of ``shard_ranks``
    under ``mode`` (one of ``MODES``) with every parameter at ``zero_stage``; bytes (``trainable``: trainable
    elements of the whole model). ``param_dtype``: the compute dtype (a stage-1/2 kept copy's; QLoRA: bf16).
    Raises ``ValueError`` where ``fully_shard`` would refuse the combination (QLoRA with stage 1 or 2)."""
    from perparam import MixedPrecisionPolicy
    from perparam.finetune.model import Llama
    from perparam.memory.plan import plan_module

    model = Llama(llama_cfg, device="meta")
    mode_cfg = LoraConfig(lora.rank, lora.alpha, lora.targets, qlora=mode == "qlora")
    if mode != "full":
        apply_lora(model, mode_cfg)
    policy = layer_policy(mode_cfg) if mode == "qlora" else None
    compute = torch.bfloat16 if policy else param_dtype
    mp = MixedPrecisionPolicy(param_dtype=compute,
                              reduce_dtype=torch.float32) if compute != torch.float32 else None
    plan = plan_module(model, shard_ranks, dtype=None, optim_bytes=ADAMW_STATE_BYTES, model_name=mode,
                       param_policy=_stage_policy(policy, zero_stage), mp_policy=mp)
    rank0 = plan.rank(0)
    row = {k: int(getattr(rank0, k)) for k in KEYS}
    return {**row, "total": sum(row.values()), "trainable": plan.trainable_params, "zero_stage": zero_stage}


def planned_bytes(llama_cfg, shard_ranks: int, lora: LoraConfig, zero_stage: int = 3,
                  param_dtype: torch.dtype = torch.float32) -> dict[str, dict[str, int]]:
    """``{mode: planned_row(...)}`` for every mode at ``zero_stage``; a mode that refuses the stage (QLoRA
    with stage 1 or 2) at stage 3 (its row's ``zero_stage`` says which). ``lora``: the adapters' rank, alpha
    and targets for the LoRA and QLoRA rows (its ``qlora`` flag is ignored)."""
    out = {}
    for mode in MODES:
        stage = 3 if mode == "qlora" else zero_stage
        out[mode] = planned_row(llama_cfg, shard_ranks, lora, mode, stage, param_dtype)
    return out


def planned_by_stage(llama_cfg, shard_ranks: int, lora: LoraConfig, mode: str,
                     param_dtype: torch.dtype = torch.float32) -> dict[str, dict | None]:
    """``{"1", "2", "3": planned_row(...)}`` of ``mode`` at each stage; ``None`` where the stage is
    refused."""
    out = {}
    for stage in (1, 2, 3):
        try:
            out[str(stage)] = planned_row(llama_cfg, shard_ranks, lora, mode, stage, param_dtype)
        except ValueError:  # QLoRA's NF4-stored base with stage 1/2 (fully_shard refuses it likewise)
            out[str(stage)] = None
    return out


def measured_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's live bytes (``perparam.memory.measure``), the NF4 scale buffers counted with the params."""
    from perparam.memory.measure import model_state_bytes, storage_bytes

    live = model_state_bytes(model, optimizer)
    row = {"params": live.params + storage_bytes(model.buffers()), "grads": live.grads,
           "optimizer": live.optimizer}
    return {**row, "total": sum(row.values())}


def mode_comparison(model: nn.Module, optimizer: torch.optim.Optimizer, shard_ranks: int,
                    lora: LoraConfig | None, zero_stage: int = 3,
                    param_dtype: torch.dtype = torch.float32) -> dict:
    """The summary's ``model_state_bytes_by_mode``: planned rows for the three modes at the stage that ran
    (``lora``'s rank, or rank 8 when this run is full fine-tuning), the mode that ran at stages 1, 2 and 3
    (``planned_rank0_by_stage``), this rank's measured row, the mode and stage that ran."""
    ran = "full" if lora is None else ("qlora" if lora.qlora else "lora")
    shown = lora or LoraConfig(8, 16.0)
    return {"planned_rank0": planned_bytes(model.cfg, shard_ranks, shown, zero_stage, param_dtype),
            "planned_rank0_by_stage": planned_by_stage(model.cfg, shard_ranks, shown, ran, param_dtype),
            "measured": measured_bytes(model, optimizer), "mode": ran, "zero_stage": zero_stage,
            "lora_rank": shown.rank, "lora_alpha": shown.alpha, "lora_targets": list(shown.targets),
            "shard_ranks": shard_ranks}


def print_mode_table(comparison: dict) -> None:
    """Rank 0: a rich table (MiB): one planned row per mode at the stage that ran, the mode that ran planned
    at ZeRO stages 1, 2 and 3, and its measured row (the stage that ran)."""
    from rich.console import Console
    from rich.table import Table

    mib = 1024 ** 2
    table = Table(title="Model state per rank by fine-tuning mode and ZeRO stage (MiB), K = "
                  f"{comparison['shard_ranks']} shard ranks, LoRA rank {comparison['lora_rank']} on "
                  f"{','.join(comparison['lora_targets'])}",
                  caption="planned: perparam.memory.plan on a meta copy (rank 0, fp32 master shards, fp32 "
                  "grads, AdamW 2 x fp32 per trainable element, QLoRA base NF4 codes + scales; stages 1/2 "
                  "add the kept whole copy in param_dtype, stage 1 the whole gradient; QLoRA refuses stages "
                  "1/2); measured: this run's live storage on rank 0, with grad padding and AdamW step "
                  "counters")
    for column in ("mode", "trainable", *KEYS, "total"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    names = {"full": "full fine-tuning", "lora": "LoRA", "qlora": "QLoRA (NF4 base)"}
    ran, stage = comparison["mode"], comparison.get("zero_stage", 3)

    def add(label: str, row: dict | None, trainable: bool = True, **style) -> None:
        if row is None:
            table.add_row(label, "", *(["refused"] * (len(KEYS) + 1)), **style)
            return
        table.add_row(label, f"{row['trainable']:,}" if trainable else "",
                      *(f"{row[k] / mib:.2f}" for k in KEYS), f"{row['total'] / mib:.2f}", **style)

    for mode, row in comparison["planned_rank0"].items():
        add(f"{names[mode]}, stage {row.get('zero_stage', 3)} (planned)", row,
            style="bold" if mode == ran else None)
    by_stage = comparison.get("planned_rank0_by_stage")
    if by_stage:
        table.add_section()
        for s, row in by_stage.items():
            add(f"{names[ran]}, stage {s} (planned)", row, style="bold" if int(s) == stage else None)
    table.add_section()
    add(f"{names[ran]}, stage {stage} (measured)", comparison["measured"], trainable=False, style="dim")
    Console().print(table)
