"""Which ZeRO stage a per-rank byte budget allows (``perparam memory --budget``), pure and exact.

For a parameter count, K data-parallel ranks and the bytes per parameter of ``BytesPerParam``, each scheme
holds Table 7-2's bytes per rank (``formulas.stage_memory``: DDP ``P + G + O``, ZeRO-1 ``P + G + O/K``,
ZeRO-2 ``P + (G + O)/K``, ZeRO-3 ``(P + G + O)/K``) and sends, per rank and step, what perparam's
implementation of it sends (ring collectives, ``r = (K - 1)/K``; ``docs/zero-stages.md``):

* DDP (``placement=Replicate()``): all-reduce of G, ``2 r G``;
* stage 1: all-reduce of G (every rank keeps the whole gradient) plus the refresh all-gather of P,
  ``2 r G + r P``: 1.5x DDP when P = G (the ZeRO paper's ZeRO-1 reduce-scatters instead: 1x);
* stage 2: reduce-scatter of G plus the refresh all-gather of P, ``r (G + P)``: DDP's bytes when P = G;
* stage 3: reduce-scatter of G plus all-gathers of P in forward and backward, ``r (G + 2 P)``: 1.5x.

The stage chosen is the one that fits with the fewest bytes sent; among equals the one holding fewer bytes
(stage 2 before DDP: the same traffic, less memory), then the lower stage. Stage 1 is never the answer:
stage 2 fits whenever it does and sends no more; stage 1 is for parameters whose whole gradient a rank
needs, not a memory/traffic trade-off. Bytes are per rank; GB = 10**9.
Only persistent model state is counted (no activations, all-gather buffers or fragmentation), and stages 1
and 2 as perparam runs them also hold the sharded copy the optimizer updates: P/K more, unless that copy is
the fp32 master already counted in O (mixed precision, the defaults here).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from perparam.memory.formulas import (
    STAGES,
    BytesPerParam,
    as_json_number,
    model_state,
    stage_communication,
    stage_memory,
)


def sent_per_step(stage: str, num_params: int, world_size: int,
                  bytes_per_param: BytesPerParam | None = None) -> Fraction:
    """Bytes one rank sends per training step under ``stage`` (one of ``formulas.STAGES``) as perparam
    implements it (see the module docstring). Raises ``ValueError`` for an unknown stage or K < 1."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    return stage_communication(stage, num_params, world_size, bytes_per_param).total


@dataclass(frozen=True)
class StageFit:
    """One scheme against a budget: ``bytes_per_rank`` (Table 7-2), ``sent_per_step`` (bytes per rank and
    step, as perparam runs it), ``ddp_sent`` (DDP's), ``budget`` (bytes per rank); all in bytes."""

    stage: str
    bytes_per_rank: Fraction
    sent_per_step: Fraction
    ddp_sent: Fraction
    budget: int

    @property
    def fits(self) -> bool:
        return self.bytes_per_rank <= self.budget

    @property
    def traffic_vs_ddp(self) -> Fraction:
        """``sent_per_step / ddp_sent`` (1 when both are 0, i.e. K = 1)."""
        return self.sent_per_step / self.ddp_sent if self.ddp_sent else Fraction(1)

    def as_dict(self) -> dict:
        return {"stage": self.stage, "bytes_per_rank": as_json_number(self.bytes_per_rank),
                "sent_per_step_bytes": as_json_number(self.sent_per_step),
                "traffic_vs_ddp": float(self.traffic_vs_ddp), "fits": self.fits,
                "headroom_bytes": as_json_number(self.budget - self.bytes_per_rank)}


def stage_fits(num_params: int, world_size: int, budget: int,
               bytes_per_param: BytesPerParam | None = None) -> list[StageFit]:
    """``StageFit`` of DDP and ZeRO-1/2/3 (``formulas.STAGES`` order) for ``budget`` bytes per rank.
    Raises ``ValueError`` for a negative budget or K < 1."""
    if budget < 0:
        raise ValueError(f"the budget must be >= 0 bytes per rank, got {budget}")
    ddp = sent_per_step("DDP", num_params, world_size, bytes_per_param)
    return [StageFit(s, stage_memory(s, num_params, world_size, bytes_per_param).total,
                     sent_per_step(s, num_params, world_size, bytes_per_param), ddp, budget) for s in STAGES]


def choose(fits: list[StageFit]) -> StageFit | None:
    """The fitting scheme with the fewest bytes sent, then the fewest held, then the lowest stage; ``None``
    when none fits."""
    ok = [(f.sent_per_step, f.bytes_per_rank, i, f) for i, f in enumerate(fits) if f.fits]
    return min(ok, key=lambda t: t[:3])[3] if ok else None


def min_world_for_zero3(num_params: int, budget: int,
                        bytes_per_param: BytesPerParam | None = None) -> int | None:
    """The smallest K at which ZeRO-3's ``(P + G + O)/K`` fits ``budget`` bytes per rank; ``None`` for a
    budget of 0 with a non-empty model."""
    total = model_state(num_params, bytes_per_param).total
    if total == 0:
        return 1
    if budget <= 0:
        return None
    return max(1, -(-total // budget))
