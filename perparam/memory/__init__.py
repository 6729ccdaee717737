"""Model-state memory of sharded data parallelism: the ZeRO formulas and the per-parameter plan.

* ``perparam.memory.formulas``: exact per-rank bytes of DDP and ZeRO-1/2/3 and their communication
  (ZeRO paper, Sections 5 and 7); pure Python, no torch.
* ``perparam.memory.plan``: per-rank bytes of a real model's ``(Shard(0),)`` layout on K ranks, computed on
  the meta device from ``perparam.sharding.layout`` (``perparam plan``).
* ``perparam.memory.presets``: a compact GPT-2 (sizes gpt2 .. gpt2-xl) for the plan.

Units: bytes; GB = 10**9 bytes.
"""

from perparam.memory.formulas import (
    GB,
    STAGES,
    BytesPerParam,
    ModelState,
    StageCommunication,
    StageMemory,
    communication_table,
    format_gb,
    memory_table,
    model_state,
    parse_count,
    stage_communication,
    stage_memory,
)

__all__ = [
    "GB",
    "STAGES",
    "BytesPerParam",
    "ModelState",
    "StageCommunication",
    "StageMemory",
    "communication_table",
    "format_gb",
    "memory_table",
    "model_state",
    "parse_count",
    "stage_communication",
    "stage_memory",
]
