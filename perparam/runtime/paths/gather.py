"""The all-gather seam: the protocol every all-gather path follows and the facts it is chosen by
(``choose.gather_path``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    import torch

    from ...sharding.layout import GroupLayout
    from ..param import ShardedParam


class Gather(NamedTuple):
    """An all-gather in flight: the path that finishes it, its send buffer (``None`` where there is none),
    its rows (``collectives.GatheredRows``), the members and their layout."""

    path: GatherPath
    send: torch.Tensor | None
    rows: object
    members: list[ShardedParam]
    layout: GroupLayout


class GatherPath(Protocol):
    """One way an all-gather moves bytes. ``part`` is the mesh part (``MeshPart``) whose members it carries;
    ``members`` a sub-list of its ``gathered`` and ``layout`` their packed layout (``GroupLayout``)."""

    name: str
    reads_shards: bool  # it reads the local shards (an offload tier's are read in first: ``offload_hook``)

    def start(self, part, members: list[ShardedParam], layout: GroupLayout) -> Gather:
        """Issue the all-gather (asynchronously) and return it in flight."""

    def finish(self, part, gather: Gather) -> None:
        """Wait for it and leave every member's unsharded buffer filled; buffers go back to the pool."""

    def pool_bytes(self, part, members: list[ShardedParam], layout: GroupLayout) -> int:
        """Bytes this path takes from the part's pool for one all-gather of ``members`` at most."""


@dataclass(frozen=True, kw_only=True)
class GatherFacts:
    """What an all-gather of one set of members is chosen by, built by keyword (hashable: a plan keeps the
    path chosen per facts): the first four are read at each unshard (``perparam.configure``,
    ``set_custom_all_gather``, hpZ's kept rows), the last two are fixed for the set (kept in the part's
    ``_gather_plan``; ``zero_copy`` from ``choose.gather_set_facts``)."""

    secondary: bool  # hpZ: rows of the same members are kept from the forward all-gather, still fresh
    custom: bool  # a custom all-gather was set (``ShardedModule.set_custom_all_gather``)
    algorithm: str  # ``RuntimeConfig.gloo_all_gather``
    hpz: bool  # the part keeps hpZ rows after forward (zero-copy would leave none to keep)
    zero_copy: bool = False  # ``gather_zero_copy.eligible``: K > 1 on gloo, every member plain ``Shard(0)``
    quantized: bool  # some member's pieces are quantized (``ShardedParam.plain`` is false)
