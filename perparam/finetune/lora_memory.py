"""The main job's model-state table by fine-tuning mode: full fine-tuning, LoRA and QLoRA per rank side by
side (params, grads, optimizer), planned from the layout for all three and measured for the mode that ran.

Planned figures come from ``perparam.memory.plan.plan_module`` on a meta-device copy of the model (no
storage; the same resolution code ``fully_shard`` runs, NF4 codes and scales included) over the
data-parallel shard axis of ``K`` ranks (an HSDP replica holds what one 1D shard group holds). Bytes of the
largest rank (rank 0: ``torch.chunk`` puts any remainder rows first), with fp32 shards (master weights),
fp32 gradients of the trainable parameters only, and AdamW's two fp32 moments (8 bytes per trainable
element; the step counters and the reduce-scatter padding are not in the plan, they are in the measured
row). The plan needs one layout per parameter, so it applies to runs without tensor parallelism only.
"""

from __future__ import annotations

import torch
from torch import nn

from perparam.finetune.lora import LoraConfig, apply_lora, layer_policy

MODES = ("full", "lora", "qlora")
ADAMW_STATE_BYTES = 8  # exp_avg and exp_avg_sq, fp32, per trainable element
KEYS = ("params", "grads", "optimizer")


def planned_bytes(llama_cfg, shard_ranks: int, lora: LoraConfig) -> dict[str, dict[str, int]]:
    """``{mode: {"params", "grads", "optimizer", "total", "trainable"}}`` for rank 0 of ``shard_ranks``;
    bytes (``trainable``: trainable elements of the whole model). ``lora``: the adapters' rank, alpha and
    targets for the LoRA and QLoRA columns (its ``qlora`` flag is ignored)."""
    from perparam import MixedPrecisionPolicy
    from perparam.finetune.model import Llama
    from perparam.memory.plan import plan_module

    out = {}
    for mode in MODES:
        model = Llama(llama_cfg, device="meta")
        mode_cfg = LoraConfig(lora.rank, lora.alpha, lora.targets, qlora=mode == "qlora")
        if mode != "full":
            apply_lora(model, mode_cfg)
        policy = layer_policy(mode_cfg) if mode == "qlora" else None
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if policy else None
        plan = plan_module(model, shard_ranks, dtype=None, optim_bytes=ADAMW_STATE_BYTES, model_name=mode,
                           param_policy=policy, mp_policy=mp)
        rank0 = plan.rank(0)
        row = {k: int(getattr(rank0, k)) for k in KEYS}
        out[mode] = {**row, "total": sum(row.values()), "trainable": plan.trainable_params}
    return out


def measured_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's live bytes (``perparam.memory.measure``), the NF4 scale buffers counted with the params."""
    from perparam.memory.measure import model_state_bytes, storage_bytes

    live = model_state_bytes(model, optimizer)
    row = {"params": live.params + storage_bytes(model.buffers()), "grads": live.grads,
           "optimizer": live.optimizer}
    return {**row, "total": sum(row.values())}


def mode_comparison(model: nn.Module, optimizer: torch.optim.Optimizer, shard_ranks: int,
                    lora: LoraConfig | None) -> dict:
    """The summary's ``model_state_bytes_by_mode``: planned rows for the three modes (``lora``'s rank, or
    rank 8 when this run is full fine-tuning), this rank's measured row and the name of the mode that ran."""
    ran = "full" if lora is None else ("qlora" if lora.qlora else "lora")
    shown = lora or LoraConfig(8, 16.0)
    return {"planned_rank0": planned_bytes(model.cfg, shard_ranks, shown), "measured": measured_bytes(model, optimizer),
            "mode": ran, "lora_rank": shown.rank, "lora_alpha": shown.alpha, "lora_targets": list(shown.targets),
            "shard_ranks": shard_ranks}


def print_mode_table(comparison: dict) -> None:
    """Rank 0: a rich table, one row per mode (planned) plus the measured row of the mode that ran (MiB)."""
    from rich.console import Console
    from rich.table import Table

    mib = 1024 ** 2
    table = Table(title=f"Model state per rank by fine-tuning mode (MiB), K = {comparison['shard_ranks']} shard "
                  f"ranks, LoRA rank {comparison['lora_rank']} on {','.join(comparison['lora_targets'])}",
                  caption="planned: perparam.memory.plan on a meta copy (rank 0, fp32 master shards, fp32 grads, "
                  "AdamW 2 x fp32 per trainable element, QLoRA base NF4 codes + scales); measured: this run's live "
                  "storage on rank 0, with grad padding and AdamW step counters")
    for column in ("mode", "trainable", *KEYS, "total"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    names = {"full": "full fine-tuning", "lora": "LoRA", "qlora": "QLoRA (NF4 base)"}
    for mode, row in comparison["planned_rank0"].items():
        table.add_row(f"{names[mode]} (planned)", f"{row['trainable']:,}", *(f"{row[k] / mib:.2f}" for k in KEYS),
                      f"{row['total'] / mib:.2f}", style="bold" if mode == comparison["mode"] else None)
    measured = comparison["measured"]
    table.add_row(f"{names[comparison['mode']]} (measured)", "", *(f"{measured[k] / mib:.2f}" for k in KEYS),
                  f"{measured['total'] / mib:.2f}", style="dim")
    Console().print(table)
