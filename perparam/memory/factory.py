"""``--model`` and the other ``package.module:name`` flags of ``perparam plan`` / ``perparam memory``: the
object imported (``import_object``), a model factory or preset resolved and called, and a model built on
the meta device (``build_on_meta``). Re-exported by ``perparam.memory.plan``."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
from torch import nn

from perparam.memory.presets import PRESETS


#: Dtype names accepted by ``--dtype`` ("model" keeps each parameter's own dtype).
def import_object(spec: str, flag: str, takes: str = "package.module:factory") -> object:
    """The object ``package.module:attr`` (dotted attributes allowed) names, for command-line flag ``flag``.
    Raises ``ValueError`` (saying what ``flag`` takes) when it cannot be imported or found, ``TypeError``
    when it is not callable."""
    hint = f"{flag} takes {takes}, importable from the current environment (check PYTHONPATH)"
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{flag} {spec!r}: expected {takes}; {hint}")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r} for {flag} {spec} ({exc}): {hint}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{module_name!r} has no attribute {attr!r} for {flag} {spec}: {hint}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{spec} ({flag}) is not callable")
    return obj


def resolve_factory(spec: str) -> tuple[Callable[[], nn.Module], str, int | None]:
    """``(factory, description, nominal_params)`` for a preset name or a ``package.module:attr`` path."""
    if spec in PRESETS:
        preset = PRESETS[spec]
        return preset.factory, preset.description, preset.nominal_params
    if ":" not in spec:
        raise ValueError(f"unknown model {spec!r}: not a preset ({', '.join(PRESETS)}) nor "
                         "package.module:factory")
    return import_object(spec, "--model"), spec, None


def call_factory(spec: str, flag: str, want: type, what: str):
    """Import ``spec`` (``import_object``), call it with no arguments and check it returned a ``want``."""
    out = import_object(spec, flag)()
    if not isinstance(out, want):
        raise TypeError(f"{spec} ({flag}) returned {type(out).__name__}; it must return {what}")
    return out


def build_on_meta(factory: Callable[[], nn.Module]) -> nn.Module:
    """Call ``factory()`` with the meta device as default: shapes and dtypes only, no storage."""
    with torch.device("meta"):
        module = factory()
    if not isinstance(module, nn.Module):
        raise TypeError(f"the factory returned {type(module).__name__}, not an nn.Module")
    return module
