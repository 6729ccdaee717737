"""Precision islands: a module computes in the dtype its own parameters ask for.

A per-parameter ``param_dtype`` is a promise about the module that owns the parameter (the module in
whose ``_parameters`` it is registered), so stock modules work under any mix of dtypes. For a
``fully_shard`` call with ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` and
``param_policy={"1.*": ParamPolicy(param_dtype=torch.float32)}`` on
``nn.Sequential(LayerNorm, Linear, ReLU, Linear)``::

    x (fp32) -> [call's input cast] -> bf16 -> 0: LayerNorm (bf16 params) -> bf16
             -> [island in]  bf16 -> fp32 -> 1: Linear (fp32 params) -> fp32 -> [island out] -> bf16
             -> 2: ReLU -> bf16 -> 3: Linear (bf16 params) -> bf16 -> output (bf16, or output_dtype)

The rule, as autocast treats its fp32 ops: walking the call's module tree from the top, a module whose
direct floating-point parameters compute in a dtype ``D`` other than the dtype around it (its nearest
ancestor's ``D``, at the top the call's ``param_dtype``) gets its floating-point inputs cast to ``D`` and
its floating-point outputs cast back to the dtype around it. With no call-wide ``param_dtype`` the
dtype around the top is the one the inputs arrive in, and islands are set up only when the call's
parameters compute in more than one dtype. Modules of groups sharded by an earlier call follow their own
call's policies. Gradients flow through the casts (``Tensor.to`` is differentiable).

A stock norm with running statistics (``BatchNorm1d/2d/3d``, ``SyncBatchNorm``, ``InstanceNorm`` with
``track_running_stats=True``, a ``LazyBatchNorm`` once initialised) computes its parameters with its
floating-point buffers, and its kernels want one dtype: its parameters compute in the buffers' dtype
(``perparam.sharding.resolution.buffer_dtypes``, passed to ``resolve_params``), so under
``param_dtype=torch.bfloat16`` the norm becomes an fp32 island by the rule above (FSDP1 kept ``_BatchNorm``
modules in fp32 by wrapping them apart; FSDP2's ``fully_shard`` casts them to ``param_dtype`` and
``F.batch_norm`` then fails with "Expected running_mean to have type BFloat16").

A stock torch module whose own direct parameters ask for two different compute dtypes cannot compute
(its ops need one dtype); it is refused at ``fully_shard`` time (``IslandError``), naming the module and
both parameters. A module of the user's own class with mixed dtypes is trusted to cast in its own
forward (as a LoRA layer with a bf16 base and fp32 adapters may): it is not made an island.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .cast import cast_floating, first_floating_dtype


class IslandError(ValueError):
    """A module whose direct parameters compute in conflicting dtypes."""


@dataclass(frozen=True)
class Island:
    """``module`` (named ``path``) computes in ``dtype``; its outputs go back to ``outer`` (``None``: the
    dtype its floating-point inputs arrived in)."""

    module: nn.Module
    path: str
    dtype: torch.dtype
    outer: torch.dtype | None


def find_islands(roots: list[tuple[str, nn.Module]], params, call_dtype: torch.dtype | None,
                 skip) -> list[Island]:
    """The islands of one ``fully_shard`` call.

    ``roots``: ``(name prefix, module)`` of the call. ``params``: ``(fqn, slots, compute dtype)`` of each
    parameter of the call (``slots``: the ``(module, attribute)`` pairs registering it; the dtype is
    ``None`` for a parameter that is not floating-point).
    ``call_dtype``: the call's ``MixedPrecisionPolicy.param_dtype``. ``skip(module)``: true for a module
    sharded by an earlier call (its subtree is not this call's). Raises ``IslandError``.
    """
    owned: dict[int, dict[torch.dtype, str]] = {}
    for fqn, slots, dtype in params:
        if dtype is None:
            continue
        for module, name in slots:
            owned.setdefault(id(module), {}).setdefault(dtype, fqn if len(slots) == 1 else f"{fqn} ({name})")
    by_id = {id(m): (f"{p}{n}".rstrip(".") or type(m).__name__, m) for p, root in roots
             for n, m in root.named_modules(prefix="")}
    for module_id, dtypes in list(owned.items()):
        if len(dtypes) > 1:
            (d1, n1), (d2, n2) = list(dtypes.items())[:2]
            path, module = by_id.get(module_id, ("?", None))
            if not type(module).__module__.startswith("torch."):
                del owned[module_id]  # the user's own forward handles its dtypes: no island
                continue
            raise IslandError(f"module '{path}' has parameters that compute in different dtypes: '{n1}' in "
                              f"{d1} and '{n2}' in {d2}. A module computes in one dtype; give both the same "
                              "param_dtype, or move one into a submodule of its own")
    compute = {d for dtypes in owned.values() for d in dtypes}
    if call_dtype is None and len(compute) <= 1:
        return []
    if call_dtype is not None and compute <= {call_dtype}:
        return []
    islands: list[Island] = []
    for prefix, root in roots:
        stack = [(prefix.rstrip("."), root, call_dtype, True, None)]
        while stack:
            path, module, outer, top, parent = stack.pop()
            if not top and skip(module):
                continue
            dtypes = owned.get(id(module))
            inner = outer
            if dtypes:
                (dtype,) = dtypes
                if outer is None or dtype != outer:
                    _check_called(path, module, dtype, parent)
                    islands.append(Island(module, path or type(module).__name__, dtype, outer))
                inner = dtype
            for name, child in reversed(list(module._modules.items())):
                if child is not None:
                    stack.append((f"{path}.{name}" if path else name, child, inner, False, module))
    return islands


_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _check_called(path: str, module: nn.Module, dtype: torch.dtype, parent: nn.Module | None) -> None:
    """An island works through its module's forward hooks. A stock torch module (other than a container)
    may use a child's parameters without calling the child (``MultiheadAttention`` reads
    ``out_proj.weight``): such a child cannot be an island."""
    if parent is None or isinstance(parent, _CONTAINERS) or not type(parent).__module__.startswith("torch."):
        return
    raise IslandError(f"module '{path}' would compute in {dtype}, but its parent {type(parent).__name__} is "
                      "a stock torch module that may use its parameters without calling it, so its inputs "
                      f"could not be cast; give the parent and '{path}' the same param_dtype (e.g. a pattern "
                      "on the parent's name + '.*')")


def install(island: Island) -> None:
    """Register the input and output casts of ``island`` on its module (after the group's pre-forward
    hook, before its post-forward hook)."""
    arrived: list[torch.dtype | None] = []  # per active call (a module may run inside itself)

    def pre(module, args, kwargs):
        if island.outer is None:
            arrived.append(first_floating_dtype((args, kwargs)))
        return cast_floating(args, island.dtype), cast_floating(kwargs, island.dtype)

    def post(module, args, kwargs, output):
        outer = island.outer
        if outer is None:
            outer = arrived.pop() if arrived else None
        return output if outer is None else cast_floating(output, outer)

    island.module.register_forward_pre_hook(pre, with_kwargs=True)
    island.module.register_forward_hook(post, with_kwargs=True, prepend=True, always_call=True)
