"""Model-state bytes read from the live shards of this rank (measured, not predicted)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor


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


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> ModelStateBytes:
    """Bytes this rank holds for ``model``'s parameters, their ``.grad``s and ``optimizer``'s state.

    Reads the live tensors: for sharded parameters that is about 1/K of the model (ZeRO-3). Returns
    ``ModelStateBytes`` in bytes.
    """
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state: list[torch.Tensor] = []
    if optimizer is not None:
        for per_param in optimizer.state.values():
            state.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
    return ModelStateBytes(storage_bytes(params), storage_bytes(grads), storage_bytes(state))
