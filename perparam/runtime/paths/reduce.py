"""The reduction seam: the protocol every reduction path follows and the facts it is chosen by
(``choose.reduce_path``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from ..param import ShardedParam
    from ..reduction import PendingReduce, ReducePlan


class ReducePath(Protocol):
    """One way a reduction moves bytes: ``issue`` starts the reduction of ``params`` (one reduce dtype and
    wire format of one mesh part; ``grads``: their gradients in ``dtype``, zeros where ``used`` is false)
    and returns it in flight, its ``recv`` the ``[n + flags]`` piece every path leaves (this rank's padded
    pieces in the plan's offsets, then the summed used flags), so what follows (``MeshPart._advance``) is
    the same for every path. A path whose output means something else says so in its ``PendingReduce``'s
    ``tail`` (``reduction.ReduceTail``: its flag rows, pieces and accumulation; ``reduce_owner.OwnerTail``),
    and one that takes parameters into a reduction of their own, through ``choose.apart``: the common tail
    (``part``, ``partial``, ``reduction``) never asks which path ran."""

    name: str

    def issue(self, part, params: tuple[ShardedParam, ...], grads: tuple[torch.Tensor, ...],
              used: tuple[bool, ...], dtype: torch.dtype, plan: ReducePlan | None) -> PendingReduce:
        ...

    def pool_bytes(self, part, params: tuple[ShardedParam, ...], dtype: torch.dtype, wire) -> int:
        """Bytes this path takes from the part's pool for one reduction of ``params`` at most."""


@dataclass(frozen=True, kw_only=True)
class ReduceFacts:
    """What a reduction of one parameter set is chosen by, built by keyword (hashable: a plan keeps the path
    chosen per facts). ``whole``, ``wire`` and the set's facts (``choose.reduce_set_facts``: ``zero_copy``)
    are fixed for the set (its key and ``ReducePlan``); the others are read at each reduction."""

    whole: bool  # replicated or stage-1 parameters: the whole gradient is all-reduced
    wire: object  # ``GradQuant`` of a low-precision reduce-scatter (qgZ), or None
    custom: bool  # a custom reduce-scatter was set (``ShardedModule.set_custom_reduce_scatter``)
    algorithm: str  # ``RuntimeConfig.gloo_reduce_scatter``
    hpz: bool  # the part keeps hpZ rows
    cpu: bool  # every gradient is on the CPU
    #: ``reduce_zero_copy.eligible``: K > 1 on gloo, every parameter plain ``Shard(0)``, no TP
    zero_copy: bool = False
    invariant: bool = False  # the call reduces in the units' tree order (``perparam.invariant``)
    #: ``update="owner"`` parameters with planned owners under ``configure(owner_grad="owner")``, no
    #: ``grad_quant``, K > 1: reduced to their owners (``reduce_owner``)
    to_owner: bool = False
    pair: bool = False  # K = 2: the sum of two pieces is the tree's one addition whatever the order
