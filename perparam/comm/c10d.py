"""The c10d functions perparam calls whose names changed between the torch versions it supports.

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``all_gather_single`` /
``reduce_scatter_single`` (the old names stay there as deprecated wrappers of the new ones); torch 2.11 and
2.12 have only the old names. The name is chosen once, at import: the new one where torch has it, else the
old one. The function is looked up by that name at each call, so whoever wraps ``torch.distributed``'s
function (a counter in a test, a profiler) sees perparam's calls.
"""

from __future__ import annotations

from types import MappingProxyType

import torch
import torch.distributed as dist

#: (new name, old name) per collective; the new name wins where torch has it
RENAMED = MappingProxyType({"all_gather": ("all_gather_single", "all_gather_into_tensor"),
                            "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor")})


def choose(prefer_old: bool = False) -> dict[str, str]:
    """The c10d function name per collective: the new name where ``torch.distributed`` has it (unless
    ``prefer_old``), else the old one; sets and returns the module's choice. Raises ``RuntimeError`` when
    torch has neither (a torch this perparam does not support)."""
    chosen = {}
    for kind, (new, old) in RENAMED.items():
        names = (old,) if prefer_old else (new, old)
        name = next((n for n in names if hasattr(dist, n)), None)
        if name is None:
            raise RuntimeError(f"torch {torch.__version__} has no torch.distributed.{new} nor .{old}: "
                               "perparam supports the torch versions pyproject.toml names")
        chosen[kind] = name
    NAMES.clear()
    NAMES.update(chosen)
    return dict(NAMES)


NAMES: dict[str, str] = {}
choose()


def all_gather_into(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup,
                    async_op: bool = False):
    """All-gather ``input`` (``[n]``) of every rank of ``group`` into ``output`` (``[K * n]``, rank order)."""
    return getattr(dist, NAMES["all_gather"])(output, input, group=group, async_op=async_op)


def reduce_scatter_into(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup,
                        async_op: bool = False):
    """Sum ``input`` (``[K * n]``) over ``group``; this rank's ``[n]`` piece into ``output``."""
    return getattr(dist, NAMES["reduce_scatter"])(output, input, group=group, async_op=async_op)
