"""``module.to(dtype)`` (``.double()``, ``.half()``, ``.bfloat16()``, ``.float()``) after ``fully_shard``: the
shards are cast and the parameters train on in the new dtype, as FSDP2's do and as one process cast the same
way would.

``nn.Module._apply`` casts each sharded DTensor (and its ``.grad``) in place, keeping the parameter objects
(torch swaps a wrapper subclass's contents). What ``fully_shard`` derived from the stored dtype is then
derived again, per parameter (``ShardedParam.recast``) and per group (``ParamGroup.relayout``): the stored
dtype is the new one; a ``param_dtype`` or ``reduce_dtype`` that was the stored dtype (the policy gave none,
or gave that dtype) follows it, one the policy set to another dtype stays (FSDP2 drops a ``param_dtype`` equal
to the parameter's dtype, and a ``reduce_dtype`` equal to the ``param_dtype``, in the same way); the
all-gather layout, the unsharded buffers (stage-1/2 kept copies included: gathered again at the next unshard)
and the plans built from them are made again.

What cannot follow is refused before anything changes (``problem``): stored-quantized parameters (their codes
and scales), offload tiers (their files and host copies are laid out in the stored dtype), a group with
precision islands, gradients held between micro-batches (accumulated without sync, or HSDP sums held by
``set_requires_all_reduce(False)``), a group in the middle of a forward or backward, a dtype torch cannot
train in (1-byte floats, complex), and optimizer state of another dtype (Adam's ``exp_avg`` after a step: a
cast leaves it as it is, and torch's optimizers then fail at the next step, as they do in one process).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..comm.collectives import all_gather_objects
from . import adopt, owner_step, registration
from .param import ShardedParam
from .state import TrainingState


def changed(params: list[ShardedParam], fn: Callable) -> list[tuple[ShardedParam, torch.dtype]]:
    """``(parameter, new dtype)`` for each of ``params`` whose stored floating-point dtype ``fn`` (what
    ``nn.Module._apply`` applies to each tensor) changes; a stored-quantized parameter is probed with its
    float32 scales. ``fn`` is tried on a 0-element tensor; one that fails there is left to ``nn.Module``."""
    out = []
    for sp in params:
        shard = sp.local_shard()
        dtype = torch.float32 if sp.stored_quantized else shard.dtype
        probe = torch.empty(0, dtype=dtype, device=shard.device)
        try:
            result = fn(probe)
        except Exception:  # not a conversion a 0-element tensor can take
            continue
        if isinstance(result, torch.Tensor) and result.dtype != probe.dtype:
            out.append((sp, result.dtype))
    return out


def problem(changes: list[tuple[ShardedParam, torch.dtype]]) -> str | None:
    """Why the stored-dtype change ``changes`` (``changed``'s result) cannot be followed, naming the first
    parameter concerned and the fix; ``None`` when it can. The same answer on every rank: an
    ``update="owner"`` parameter's optimizer state is whole on its owner and absent elsewhere, so the ranks
    of its shard axis agree on the first reason any of them found (one small all-gather per such axis,
    only for a cast that changes owner parameters); otherwise the owner refused and its peers cast."""
    reason = _local_problem(changes)
    groups: dict = {}
    for sp, _ in changes:
        if sp.policy.update == "owner":
            pg = owner_step.shard_group(sp)
            groups.setdefault(id(pg), pg)
    for pg in groups.values():
        reason = next((r for r in all_gather_objects(reason, pg) if r is not None), None)
    return reason


def _local_problem(changes: list[tuple[ShardedParam, torch.dtype]]) -> str | None:
    for sp, dtype in changes:
        what = f"'{sp.path}' ({sp.policy.stored_dtype} -> {dtype})"
        if not dtype.is_floating_point or dtype.itemsize == 1:
            return (f"{what}: perparam trains floating-point parameters of 2 or more bytes; for an fp8 "
                    "all-gather use ParamPolicy(quant=QuantPolicy('fp8'))")
        if sp.stored_quantized:
            return (f"{what} is stored quantized ({sp.policy.quant.quantizer.name} codes and fp32 scales), "
                    "which a cast cannot change; cast the model before fully_shard, or give the other "
                    "parameters their dtype with .to() on their own modules")
        if sp.policy.offload.offloaded:
            return (f"{what} is offloaded to {sp.policy.offload.tier!r}, whose storage is laid out in the "
                    "stored dtype; cast the model before fully_shard")
        group = registration.group_holding(sp)
        if group is None:
            continue
        if group.islands:
            return (f"{what} is in group [{group.name}], which has precision islands (modules computing in "
                    "their own dtype); cast the model before fully_shard")
        if group.state is not TrainingState.IDLE:
            return f"{what}: group [{group.name}] is in its {group.state.value}; cast between steps"
        if sp.grad_acc is not None or group.held_unsynced or any(part.partial_reduce for part in group.parts):
            return (f"{what}: group [{group.name}] holds gradients accumulated without sync; finish the "
                    "accumulation (a backward with set_requires_gradient_sync(True) and the optimizer step) "
                    "before the cast")
        state = [(opt, key, old) for opt, key, old in adopt.state_dtypes(sp) if old != dtype]
        if state:
            opt, key, old = state[0]
            return (f"{what}: {opt} holds its state '{key}' for it in {old}, which the cast would leave as "
                    "it is (torch's optimizers then fail at the next step, as in one process). Build the "
                    "optimizer after the cast, or cast its state first: for s in opt.state.values(): "
                    f"s.update({{k: v.to({dtype}) for k, v in s.items() if v.is_floating_point() and "
                    f"v.dim()}})")
    return None


def follow(params: list[ShardedParam]) -> None:
    """After ``nn.Module._apply`` cast the sharded DTensors: re-derive every parameter of ``params`` whose
    shard's dtype is no longer its stored dtype, then the layouts of their groups. Idempotent (a module's
    ``_apply`` runs inside its parent's)."""
    groups = {}
    for sp in params:
        if sp.recast():
            group = registration.group_holding(sp)
            if group is not None:
                groups[id(group)] = group
    for group in groups.values():
        group.relayout()
