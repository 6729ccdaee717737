"""Gradient clipping across parameters that live on different meshes (DP-only, HSDP, DP+TP)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.nn.utils import clip_grads_with_norm_, get_total_norm


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """Clip gradients by their global norm; returns that norm (a plain 0-dim tensor, same on every rank).

    ``torch.nn.utils.clip_grad_norm_`` stacks per-tensor norms, which fails when gradients are DTensors
    on different meshes (a model mixing tensor-parallel and data-parallel-only parameters). Here each
    mesh's gradients are reduced to one norm (``get_total_norm`` then ``full_tensor``), and the norm of
    those norms is the global norm.
    """
    params = [p for p in parameters if p.grad is not None]
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in params:
        key = (p.grad.device_mesh, tuple(p.grad.placements)) if isinstance(p.grad, DTensor) else None
        by_mesh.setdefault(key, []).append(p.grad)
    norms = []
    for grads in by_mesh.values():
        norm = get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.tensor(0.0)
    total = get_total_norm(norms, norm_type, error_if_nonfinite, foreach)
    for grads in by_mesh.values():
        clip_grads_with_norm_(grads_holder(grads), max_norm, total, foreach)
    return total


class _GradHolder:
    """``clip_grads_with_norm_`` reads ``.grad`` off what it is given."""

    def __init__(self, grad: torch.Tensor) -> None:
        self.grad = grad


def grads_holder(grads: list[torch.Tensor]) -> list[_GradHolder]:
    return [_GradHolder(g) for g in grads]
