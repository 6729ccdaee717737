"""What a user registered before ``fully_shard`` keeps working after it.

``fully_shard`` replaces each ``nn.Parameter`` by a new ``nn.Parameter(DTensor)`` (a plain tensor and a
DTensor cannot swap contents in place: ``torch.utils.swap_tensors`` refuses objects with different slots).
So that the replacement is invisible where it can be:

* the attributes a user set on a parameter (``p.no_decay = True``) are copied onto its sharded parameter;
* an optimizer built before ``fully_shard`` is retargeted at its first ``step()``: a global optimizer
  step pre-hook replaces, in its ``param_groups``, every parameter ``fully_shard`` replaced by the sharded
  one, so it trains exactly like an optimizer built after. An optimizer that already holds state for a
  replaced parameter (it stepped before sharding) is refused with ``ShardingError``. Cost: one dict
  lookup per step once an optimizer has been checked;
* every optimizer step is counted (a global step post-hook), so parameters kept gathered across steps
  (``set_reshard_after_backward(False)``) are all-gathered afresh after one, whatever the optimizer's
  update path (foreach updates do not bump a DTensor's version counter);
* a parameter assigned after ``fully_shard`` (``module.weight = nn.Parameter(...)``) is refused with a
  clear error at the next forward or unshard (``ShardedParam.register``), instead of being silently put
  back.

References a user took before ``fully_shard`` (``w = model.weight``) still point at the old, unsharded
tensor: take them after.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

#: original parameter -> the sharded parameter that replaced it (weak on the original)
_REPLACED: WeakIdKeyDictionary = WeakIdKeyDictionary()
_generation = 0
_checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> generation checked
_steps = 0

#: attributes nn.Parameter / DTensor keep in ``__dict__`` themselves: never copied
_INTERNAL = {"_is_param", "_local_tensor", "_spec"}


class ReplacedParameterError(RuntimeError):
    """An optimizer holds state for a parameter that ``fully_shard`` replaced."""


def record(original: torch.Tensor, sharded: torch.Tensor) -> None:
    """Remember that ``sharded`` replaced ``original`` and copy the user's attributes onto it."""
    global _generation
    for key, value in original.__dict__.items():
        if key not in _INTERNAL and key not in sharded.__dict__:
            sharded.__dict__[key] = value
    _REPLACED[original] = sharded
    _generation += 1


def optimizer_steps() -> int:
    """How many ``torch.optim`` optimizer steps this process has taken: parameters gathered before a step
    are stale after it (``ParamGroup.stale``)."""
    return _steps


def _count_step(optimizer, args, kwargs) -> None:
    global _steps
    _steps += 1


def _retarget(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if _checked.get(optimizer) == _generation:
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
    _checked[optimizer] = _generation


register_optimizer_step_pre_hook(_retarget)
register_optimizer_step_post_hook(_count_step)
