"""Casting floating-point tensors nested in forward inputs and outputs (mixed precision).

Containers are rebuilt only where a tensor inside them changed, and then exactly: every other field,
attribute and entry comes back as it was (``init=False`` dataclass fields, ``__slots__``, frozen
dataclasses, a ``defaultdict``'s factory, a namedtuple's type). Where nothing changed the object itself
is returned (identity preserved).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch


def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def replace_tensors(obj: Any, fn) -> Any:
    """``obj`` with every tensor ``t`` replaced by ``fn(t)``.

    Walks tuples, lists, dicts, namedtuples and dataclass instances (every field, ``init=False`` ones
    too). A container none of whose tensors changed is returned as is; one that changed is a shallow
    copy with only the changed entries replaced. Anything else is returned as is.
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        # (tensor entries inline: the common forward argument, one call fewer per tensor)
        values = [fn(v) if isinstance(v, torch.Tensor) else replace_tensors(v, fn) for v in obj]
        if all(a is b for a, b in zip(values, obj)):
            return obj
        if isinstance(obj, tuple):
            return type(obj)(*values) if hasattr(obj, "_fields") else type(obj)(values)
        out = copy.copy(obj)  # a list subclass keeps its type and attributes
        out[:] = values
        return out
    if isinstance(obj, dict):
        changed = {k: nv for k, v in obj.items() if (nv := replace_tensors(v, fn)) is not v}
        if not changed:
            return obj
        out = copy.copy(obj)  # keeps OrderedDict order, a defaultdict's factory
        out.update(changed)
        return out
    if _is_dataclass_instance(obj):
        changed = {f.name: nv for f in dataclasses.fields(obj)
                   if (nv := replace_tensors(getattr(obj, f.name), fn)) is not getattr(obj, f.name)}
        if not changed:
            return obj
        out = copy.copy(obj)  # every field as the caller set it, init=False ones and slots included
        for name, value in changed.items():
            object.__setattr__(out, name, value)  # frozen dataclasses too
        return out
    return obj


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """``obj`` with every floating-point tensor cast to ``dtype`` (containers as ``replace_tensors``);
    integer, bool and complex tensors and non-tensors pass through untouched."""
    return replace_tensors(obj, lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t)


def first_floating_dtype(obj: Any) -> torch.dtype | None:
    """The dtype of the first floating-point tensor nested in ``obj``, or ``None``."""
    return next((t.dtype for t in tensors_in(obj) if t.is_floating_point()), None)


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor nested in ``obj`` (same containers as ``cast_floating``)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple, dict)):
        out = []
        for v in obj.values() if isinstance(obj, dict) else obj:
            if isinstance(v, torch.Tensor):  # (inline: the common forward argument, one call fewer)
                out.append(v)
            else:
                out += tensors_in(v)
        return out
    if _is_dataclass_instance(obj):
        return [t for f in dataclasses.fields(obj) for t in tensors_in(getattr(obj, f.name))]
    return []


def tensors_anywhere(obj: Any, _seen: set | None = None) -> list[torch.Tensor]:
    """Every tensor ``tensors_in`` finds, plus those held by other objects: instances of plain classes
    (their ``__dict__`` and ``__slots__``), sets, and containers nested in them; each object walked once
    (cycles end). Modules, classes and functions are not walked (their parameters are not outputs)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    seen = set() if _seen is None else _seen
    if id(obj) in seen or obj is None or isinstance(obj,
                                                    (str, bytes, int, float, bool, type, torch.nn.Module)):
        return []
    seen.add(id(obj))
    if isinstance(obj, dict):
        values = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        values = list(obj)
    else:
        values = list(getattr(obj, "__dict__", {}).values()) if not callable(obj) else []
        for cls in type(obj).__mro__:
            slots = cls.__dict__.get("__slots__", ())
            for name in (slots,) if isinstance(slots, str) else slots:
                if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                    values.append(getattr(obj, name))
    return [t for v in values for t in tensors_anywhere(v, seen)]
