"""What a user registered before ``fully_shard`` keeps working after it.

``fully_shard`` replaces each ``nn.Parameter`` by a new ``nn.Parameter(DTensor)`` (a plain tensor and a
DTensor cannot swap contents in place: ``torch.utils.swap_tensors`` refuses objects with different slots).
So that the replacement is invisible where it can be:

* the attributes a user set on a parameter (``p.no_decay = True``) are copied onto its sharded parameter,
  and so are its post-accumulate-grad hooks (``register_post_accumulate_grad_hook``; a ``register_hook``
  hook, which could never fire, is refused by ``fully_shard``);
* an optimizer built before ``fully_shard`` is retargeted at its first ``step()``: an optimizer step
  pre-hook replaces, in its ``param_groups``, every parameter ``fully_shard`` replaced by the sharded
  one, so it trains exactly like an optimizer built after. An optimizer that already holds state for a
  replaced parameter (it stepped before sharding) is refused with ``ReplacedParameterError``. The hook is
  global (an optimizer built before sharding is nowhere else to be found), installed by the first
  ``fully_shard`` of the process, never at import; cost: one dict lookup per step once an optimizer has
  been checked (again when ``fully_shard`` ran since, or its ``param_groups`` grew);
* the steps of every optimizer holding perparam parameters are counted on the parameters it holds
  (``ShardedParam.optimizer_steps``, bumped by a post-hook registered on that optimizer alone, when the
  pre-hook first sees it holding one), so parameters kept gathered across steps
  (``set_reshard_after_backward(False)``) are all-gathered afresh after one, whatever the optimizer's
  update path (foreach updates do not bump a DTensor's version counter). Optimizers of other models in
  the process, and other ranks' optimizers when ranks are threads of one process, never make this
  rank's parameters stale;
* an optimizer that flattens each gradient into one vector (``torch.optim.LBFGS``: ``p.grad.view(-1)``, the
  only one in ``torch.optim`` that does) is refused at its first step, before it computes anything, when it
  holds a parameter whose DTensor cannot be flattened (a ``Shard(d)`` placement whose dim ``d`` does not
  divide evenly over the shard axis): ``UnflattenableShardError`` names the parameter and the placements
  that work;
* a parameter assigned after ``fully_shard`` (``module.weight = nn.Parameter(...)``) is refused with a
  clear error at the next forward or unshard (``ShardedParam.register``), instead of being silently put
  back.

References a user took before ``fully_shard`` (``w = model.weight``) still point at the old, unsharded
tensor: take them after.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from ..sharding.errors import MetaParameterError, ShardingError
from ..sharding.placement import placement_str
from . import local_step, mixed_step, owner_state, owner_step
from .untraced import untraced

#: original parameter -> the sharded parameter that replaced it (weak on the original)
_REPLACED: WeakIdKeyDictionary = WeakIdKeyDictionary()
_generation = 0
#: the live ``ShardedParam``s (weak; never a weak reference to a tensor: ``torch.utils.swap_tensors``,
#: which ``to_empty`` may use, refuses tensors that have one): an optimizer holding one of their sharded
#: parameters has its steps counted
_OWNERS: weakref.WeakSet = weakref.WeakSet()
_checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> (generation, groups) checked
_counted: weakref.WeakSet = weakref.WeakSet()  # optimizers whose steps are counted
#: optimizer -> the ``ShardedParam``s whose sharded parameters it holds (as of its last check)
_held: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_pre_hook = None  # the global step pre-hook's handle, once the first fully_shard installed it

#: attributes nn.Parameter / DTensor keep in ``__dict__`` themselves: never copied
_INTERNAL = {"_is_param", "_local_tensor", "_spec"}


class ReplacedParameterError(RuntimeError):
    """An optimizer holds state for a parameter that ``fully_shard`` replaced."""


class UnflattenableShardError(ShardingError, RuntimeError):
    """An optimizer that flattens gradients (``torch.optim.LBFGS``) holds a parameter whose sharded DTensor
    cannot be flattened (DTensor refuses ``view(-1)`` of a dim sharded unevenly)."""


#: optimizers that flatten every parameter and gradient into one vector (``view(-1)``): of ``torch.optim``
#: (2.13) only LBFGS; the others update each tensor elementwise, in its placement
FLATTENING_OPTIMIZERS: tuple[type, ...] = (torch.optim.LBFGS,)


def record(original: torch.Tensor, owner) -> None:
    """Remember that ``owner.sharded`` (``owner``: a ``ShardedParam``) replaced ``original`` and copy the
    user's attributes onto it, and its post-accumulate-grad hooks: the same dict, so a handle taken before
    ``fully_shard`` still removes the hook (perparam runs them on the sharded parameter after each
    reduction, ``IterationContext``)."""
    global _generation
    sharded = owner.sharded
    for key, value in original.__dict__.items():
        if key not in _INTERNAL and key not in sharded.__dict__:
            sharded.__dict__[key] = value
    if original._post_accumulate_grad_hooks:
        sharded._post_accumulate_grad_hooks = original._post_accumulate_grad_hooks
    _REPLACED[original] = sharded
    _OWNERS.add(owner)
    _generation += 1
    _install()


def _install() -> None:
    """The optimizer step pre-hook, registered once, by the first ``fully_shard`` (not at import)."""
    global _pre_hook
    if _pre_hook is None:
        _pre_hook = register_optimizer_step_pre_hook(untraced(_retarget))  # eager in a compiled step too


def _count_step(optimizer) -> None:
    """A step of ``optimizer`` changed the parameters it holds: storage gathered before is stale. A frozen
    parameter holding a ``.grad`` was stepped too (torch's optimizers step every parameter with a gradient:
    zeros left by ``zero_grad(set_to_none=False)`` still get weight decay and momentum): its stage-1/2 kept
    copy is marked stale outright, since ``runtime.zero.needs_refresh`` skips a parameter frozen when
    gathered and frozen now. Whether it holds a ``.grad`` is the same on every rank (reductions set it on
    all ranks alike)."""
    for sp in _held.get(optimizer, ()):
        sp.optimizer_steps += 1
        if sp.kept:
            sharded = sp.sharded
            if not sharded.requires_grad and sharded.grad is not None:
                sp.kept_key = None


def state_dtypes(sp) -> list[tuple[str, str, torch.dtype]]:
    """``(optimizer class, state key, dtype)`` of each floating-point state tensor of the parameter's shape
    (``exp_avg``, ``momentum_buffer``, ...) that an optimizer holding ``sp`` (one that has stepped) keeps for
    it: what a cast of the parameters (``perparam.runtime.recast``) leaves in its dtype."""
    out = []
    for optimizer, held in list(_held.items()):
        if sp not in held:
            continue
        for key, value in optimizer.state.get(sp.sharded, {}).items():
            if (isinstance(value, torch.Tensor) and value.is_floating_point()
                    and tuple(value.shape) == tuple(sp.sharded.shape)):
                out.append((type(optimizer).__name__, key, value.dtype))
    return out


def _retarget(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    key = (_generation, len(optimizer.param_groups))
    if _checked.get(optimizer) == key:
        return
    for group in optimizer.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            sharded = _REPLACED.get(p)
            if sharded is None:
                continue
            if optimizer.state.get(p):
                raise ReplacedParameterError(
                    f"{type(optimizer).__name__} holds state for a parameter of shape {tuple(p.shape)} that "
                    "fully_shard has since replaced by a sharded DTensor; build the optimizer after fully_shard. To "
                    "keep the state it has, take it before fully_shard with torch.distributed.checkpoint.state_dict."
                    "get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True)) and "
                    "load it into the new optimizer with set_optimizer_state_dict(model, new_optimizer, state, "
                    "options=StateDictOptions(full_state_dict=True))")
            params[i] = sharded
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    mine = weakref.WeakSet(sp for sp in list(_OWNERS) if id(sp.sharded) in held)
    _check_materialized(optimizer, mine)
    if isinstance(optimizer, FLATTENING_OPTIMIZERS):
        _check_flattenable(optimizer, mine)
    owner_step.check(optimizer, mine)  # a whole-matrix optimizer on shards: refused, never silently wrong
    mixed_step.watch(optimizer, mine, lambda opt: _held.get(opt, ()))  # another's DTensor mix error, named
    owner_step.plan(optimizer, mine)  # the owners of its update="owner" parameters
    owner_state.install(optimizer)  # their state in state_dict()/load_state_dict() as any parameter's
    _held[optimizer] = mine
    if optimizer not in _counted and mine:
        _counted.add(optimizer)
        # one hook pair: the post-hook counts the step; update="owner" parameters are routed to their
        # owners (``owner_step``); SGD/Adam/AdamW also step on the local shards
        local_step.install(optimizer, lambda opt: _held.get(opt, ()), _count_step)
    _checked[optimizer] = key


def _check_materialized(optimizer: torch.optim.Optimizer, held) -> None:
    """Raise ``MetaParameterError`` naming the first parameter of ``held`` (in the optimizer's order) still on the meta
    device: a step would change nothing (no storage, no gradient), silently. Checked with the optimizer's
    parameters (its first step, and after a ``fully_shard`` or a new parameter group), not at every step:
    a model given storage is not put back on ``meta``."""
    by_id = {id(sp.sharded): sp for sp in held}
    for p in (p for g in optimizer.param_groups for p in g["params"]):
        sp = by_id.get(id(p))
        if sp is not None and p.device.type == "meta":
            raise MetaParameterError(
                f"{type(optimizer).__name__}.step(): parameter '{sp.path}' is still on the meta device (a model built "
                "under torch.device('meta') has no values yet), so the step would change nothing. Before the first "
                "step call model.to_empty(device=...) and initialise it (e.g. reset_parameters() on each module), or "
                "load weights with perparam.checkpoint.load_full_state_dict(model, state_dict)")


def _check_flattenable(optimizer: torch.optim.Optimizer, held) -> None:
    """Raise ``UnflattenableShardError`` for the first parameter of ``held`` (``ShardedParam``s, in
    ``fqn`` order) whose sharded DTensor DTensor cannot flatten. The trial ``view(-1)`` is local (a view
    never communicates) and decided from global shapes and placements, so every rank decides alike."""
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
                f"{type(optimizer).__name__} flattens every gradient (p.grad.view(-1)), and parameter '{sp.path}' "
                f"(shape {tuple(sharded.shape)}, placements ({placements}) over {sharded.device_mesh.size()} "
                f"ranks) cannot be flattened: {reason}. Shard it evenly or replicate it: fully_shard(..., "
                f"param_policy={{'{sp.fqn}': ParamPolicy(placement='auto')}}) (the dim with the least padding; "
                "Replicate() for a tiny parameter) or ParamPolicy(placement=Replicate()), or use an optimizer "
                "that updates each parameter on its own (SGD, Adam, AdamW)") from None
