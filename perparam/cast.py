"""Casting floating-point tensors nested in forward inputs and outputs (mixed precision)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


def replace_tensors(obj: Any, fn) -> Any:
    """``obj`` with every tensor ``t`` replaced by ``fn(t)``.

    Walks tuples, lists, dicts, namedtuples and dataclass instances (frozen ones too, rebuilt with
    ``dataclasses.replace``); everything else is returned as is.
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(replace_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(replace_tensors(v, fn) for v in obj)
    if isinstance(obj, dict):
        return type(obj)((k, replace_tensors(v, fn)) for k, v in obj.items())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: replace_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """``obj`` with every floating-point tensor cast to ``dtype`` (containers as ``replace_tensors``)."""
    return replace_tensors(obj, lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t)


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor nested in ``obj`` (same containers as ``cast_floating``)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_in(v)]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_in(v)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in tensors_in(getattr(obj, f.name))]
    return []
