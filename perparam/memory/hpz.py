"""ZeRO++'s hpZ model (Wang et al., "ZeRO++: Extremely Efficient Collective Communication for Giant Model
Training", 2023, Section 3.2): the bytes one rank sends in a step's parameter all-gathers and the memory
the secondary partition adds, for a group whose gathered parameters are P bytes."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction


@dataclass(frozen=True)
class HpzModel:
    """Per rank, for a group of P gathered bytes on K ranks with a secondary partition of k' ranks.

    ``forward_sent``: the forward all-gather over K ranks, ``(K - 1) / K * P`` bytes sent (ring).
    ``backward_sent``: the backward all-gather over the k' ranks of the secondary group,
    ``(k' - 1) / k' * P`` (ZeRO-3 without hpZ: ``(K - 1) / K * P`` over all K ranks).
    ``secondary_bytes``: the secondary shard held from forward to backward, ``P / k'`` bytes.
    """

    param_bytes: int
    world_size: int
    secondary_size: int
    forward_sent: Fraction
    backward_sent: Fraction
    zero3_backward_sent: Fraction
    secondary_bytes: Fraction


def hpz_model(param_bytes: int, world_size: int, secondary_size: int) -> HpzModel:
    """The model for P = ``param_bytes`` (bytes all-gathered, padding included), K = ``world_size`` ranks
    on the shard axis and k' = ``secondary_size``.

    Raises ``ValueError`` unless k' divides K and P >= 0."""
    if world_size < 1 or secondary_size < 1 or world_size % secondary_size or param_bytes < 0:
        raise ValueError(f"hpz_model: secondary size {secondary_size} must divide the world size "
                         f"{world_size} and the bytes ({param_bytes}) be >= 0")
    p = Fraction(param_bytes)
    return HpzModel(param_bytes, world_size, secondary_size,
                    forward_sent=p * Fraction(world_size - 1, world_size),
                    backward_sent=p * Fraction(secondary_size - 1, secondary_size),
                    zero3_backward_sent=p * Fraction(world_size - 1, world_size),
                    secondary_bytes=p / secondary_size)
