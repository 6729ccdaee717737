"""The ``Retarget`` stage: an optimizer pointed at the sharded parameters and checked, before the user's
step pre-hooks run (torch's global pre-hook, ``Binding.first``).

At an optimizer's first step, and again when ``fully_shard`` ran since or its ``param_groups`` grew (one
tuple comparison per step otherwise): every parameter ``fully_shard`` replaced is replaced, in its
``param_groups``, by the sharded one (an optimizer built before ``fully_shard`` trains exactly like one built
after; one that already holds state for a replaced parameter is refused with ``ReplacedParameterError``);
the ``ShardedParam``s it holds become its binding's ``held``; what it cannot step is refused before it
computes anything (a parameter still on the meta device, a flattening optimizer on an unflattenable shard,
a whole-matrix optimizer on row shards: ``owner_step.check``); its ``update="owner"`` parameters get their
owners (``owner_step.plan``, owners planned before kept); and its binding installs perparam's step hooks
once it holds a perparam parameter.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor

from ...sharding.errors import MetaParameterError, ShardingError
from ...sharding.placement import placement_str
from .. import mixed_step, owner_step
from ..live_groups import GROUPS
from .registry import REGISTRY


class ReplacedParameterError(RuntimeError):
    """An optimizer holds state for a parameter that ``fully_shard`` replaced."""


class UnflattenableShardError(ShardingError, RuntimeError):
    """An optimizer that flattens gradients (``torch.optim.LBFGS``) holds a parameter whose sharded DTensor
    cannot be flattened (DTensor refuses ``view(-1)`` of a dim sharded unevenly)."""


#: optimizers that flatten every parameter and gradient into one vector (``view(-1)``): of ``torch.optim``
#: (2.13) only LBFGS; the others update each tensor elementwise, in its placement
FLATTENING_OPTIMIZERS: tuple[type, ...] = (torch.optim.LBFGS,)


class Retarget:
    """The stage; ``key``: (``REGISTRY.generation``, number of parameter groups) when last checked."""

    first = True

    def __init__(self) -> None:
        self.key = None

    def before(self, step, binding) -> None:
        optimizer = step.optimizer
        key = (REGISTRY.generation, len(optimizer.param_groups))
        if self.key == key:
            return
        for group in optimizer.param_groups:
            params = group["params"]
            for i, p in enumerate(params):
                replaced = REGISTRY.replaced.get(p)
                if replaced is None:
                    continue
                if optimizer.state.get(p):
                    raise ReplacedParameterError(
                        f"{type(optimizer).__name__} holds state for a parameter of shape {tuple(p.shape)} "
                        "that fully_shard has since replaced by a sharded DTensor; build the optimizer after "
                        "fully_shard. To keep the state it has, take it before fully_shard with "
                        "torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, optimizer, "
                        "options=StateDictOptions(full_state_dict=True)) and load it into the new optimizer "
                        "with set_optimizer_state_dict(model, new_optimizer, state, "
                        "options=StateDictOptions(full_state_dict=True))")
                params[i] = replaced.sharded
        found = (GROUPS.sharded_param(p) for g in optimizer.param_groups for p in g["params"])
        mine = weakref.WeakSet(sp for sp in found if sp is not None)
        _check_materialized(optimizer, mine)
        if isinstance(optimizer, FLATTENING_OPTIMIZERS):
            _check_flattenable(optimizer, mine)
        owner_step.check(optimizer, mine)  # a whole-matrix optimizer on shards: refused, never silently wrong
        mixed_step.watch(optimizer, mine, binding)  # another's DTensor mix error, named
        # the owners of its update="owner" parameters
        binding.route = owner_step.plan(optimizer, mine, binding.route)
        binding.held = mine
        binding.install(optimizer)
        self.key = key

    def after(self, step, binding) -> None:
        return None


def _check_materialized(optimizer: torch.optim.Optimizer, held) -> None:
    """Raise ``MetaParameterError`` naming the first parameter of ``held`` (in the optimizer's order) still on
    the meta device: a step would change nothing (no storage, no gradient), silently. Checked with the
    optimizer's parameters (its first step, and after a ``fully_shard`` or a new parameter group), not at
    every step: a model given storage is not put back on ``meta``."""
    by_id = {id(sp.sharded): sp for sp in held}
    for p in (p for g in optimizer.param_groups for p in g["params"]):
        sp = by_id.get(id(p))
        if sp is not None and p.device.type == "meta":
            raise MetaParameterError(
                f"{type(optimizer).__name__}.step(): parameter '{sp.path}' is still on the meta device (a "
                "model built under torch.device('meta') has no values yet), so the step would change "
                "nothing. Before the first step call model.to_empty(device=...) and initialise it (e.g. "
                "reset_parameters() on each module), or load weights with "
                "perparam.checkpoint.load_full_state_dict(model, state_dict)")


def _check_flattenable(optimizer: torch.optim.Optimizer, held) -> None:
    """Raise ``UnflattenableShardError`` for the first parameter of ``held`` (``ShardedParam``s, in ``fqn``
    order) whose sharded DTensor DTensor cannot flatten. The trial ``view(-1)`` is local (a view never
    communicates) and decided from global shapes and placements, so every rank decides alike."""
    for sp in sorted(held, key=lambda s: s.fqn):
        sharded = sp.sharded
        if not isinstance(sharded, DTensor):
            continue
        try:
            with torch.no_grad():
                sharded.view(-1)
        except RuntimeError as e:
            reason = str(e).split("\n")[0].rstrip(".")
            placements = ", ".join(placement_str(p) for p in sharded.placements)
            raise UnflattenableShardError(
                f"{type(optimizer).__name__} flattens every gradient (p.grad.view(-1)), and parameter "
                f"'{sp.path}' (shape {tuple(sharded.shape)}, placements ({placements}) over "
                f"{sharded.device_mesh.size()} ranks) cannot be flattened: {reason}. Shard it evenly or "
                f"replicate it: fully_shard(..., param_policy={{'{sp.fqn}': ParamPolicy(placement='auto')}}) "
                "(the dim with the least padding; Replicate() for a tiny parameter) or "
                "ParamPolicy(placement=Replicate()), or use an optimizer that updates each parameter on its "
                "own (SGD, Adam, AdamW)") from None
