"""Model-state bytes read from the live shards of this rank (measured, not predicted)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from perparam.sharding.live import ReportsKeptCopies


@dataclass(frozen=True)
class ModelStateBytes:
    """This rank's bytes of parameters, gradients and optimizer state (storage actually allocated)."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict[str, int]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer, "total": self.total}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shards).

    A storage shared by several tensors (e.g. gradients that are views of one reduce-scatter output)
    counts once, with its full size, padding included.
    """
    seen: dict[int, int] = {}
    for t in tensors:
        local = _local(t)
        if local.is_meta:
            seen[id(local)] = local.numel() * local.element_size()
            continue
        storage = local.untyped_storage()
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


def kept_copies(model: nn.Module) -> list[torch.Tensor]:
    """The unsharded buffers that stage-1/2 parameters (``ParamPolicy.zero_stage``) of ``model`` keep
    across steps on this rank (padded, ``param_dtype``), where their storage is alive: what each sharded
    module reports (``perparam.sharding.live.ReportsKeptCopies``), each tensor once."""
    out, seen = [], set()
    for module in model.modules():
        if isinstance(module, ReportsKeptCopies):
            for t in module._perparam_kept_unsharded():
                if id(t) not in seen:
                    seen.add(id(t))
                    out.append(t)
    return out


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> ModelStateBytes:
    """Bytes this rank holds for ``model``'s parameters, their ``.grad``s and ``optimizer``'s state.

    Reads the live tensors: for sharded parameters that is about 1/K of the model (ZeRO-3). Stage-1/2
    parameters add their kept unsharded copy to ``params`` (``kept_copies``); a stage-1 ``.grad`` is a
    view of a whole gradient, counted whole. Returns ``ModelStateBytes`` in bytes.
    """
    params = list(model.parameters()) + kept_copies(model)
    grads = [p.grad for p in params if p.grad is not None]
    state: list[torch.Tensor] = []
    if optimizer is not None:
        for per_param in optimizer.state.values():
            state.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
    return ModelStateBytes(storage_bytes(params), storage_bytes(grads), storage_bytes(state))


def shard_factor(p: torch.Tensor) -> int:
    """Into how many pieces the ranks split ``p``: the product of the sizes of its mesh axes that shard it
    (``Shard`` and the ``_StridedShard`` of a dim split by both dp and tp); replicated axes (HSDP's) do not
    count; 1 for a plain tensor."""
    if not isinstance(p, DTensor):
        return 1
    from torch.distributed.tensor.placement_types import _StridedShard

    return math.prod(p.device_mesh.size(axis) for axis, pl in enumerate(p.placements)
                     if pl.is_shard() or isinstance(pl, _StridedShard))


def zero3_state_bytes(model: nn.Module, optimizer_states: int = 2) -> tuple[dict[str, int], dict[str, float]]:
    """``(unsharded, zero3)`` model-state bytes of a sharded ``model`` with an Adam-like optimizer.

    ``unsharded``: one rank holding everything in the stored dtype: ``P``, ``G`` (stored dtype) and ``O``
    (``optimizer_states`` tensors like the parameter; AdamW: 2), ``G`` and ``O`` for parameters that
    require grad only (a frozen LoRA base has neither). ``zero3``: each parameter's ZeRO-3 share
    ``(P + G + O) / k`` (Rajbhandari et al., 2020, Section 5), ``k`` its ``shard_factor`` (the dp shard
    axis, times the tp axis for tensor-parallel weights). Bytes; no padding, no step counters.
    """
    unsharded = {"params": 0, "grads": 0, "optimizer": 0}
    zero3 = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    for p in model.parameters():
        full = p.numel() * p.element_size()
        k = shard_factor(p)
        trained = 1 if p.requires_grad else 0
        for key, mult in (("params", 1), ("grads", trained), ("optimizer", optimizer_states * trained)):
            unsharded[key] += mult * full
            zero3[key] += mult * full / k
    return unsharded, zero3
