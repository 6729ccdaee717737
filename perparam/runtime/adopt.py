"""What a user registered before ``fully_shard`` keeps working after it.

``fully_shard`` replaces each ``nn.Parameter`` by a new ``nn.Parameter(DTensor)`` (a plain tensor and a
DTensor cannot swap contents in place: ``torch.utils.swap_tensors`` refuses objects with different slots).
So that the replacement is invisible where it can be:

* the attributes a user set on a parameter (``p.no_decay = True``) are copied onto its sharded parameter,
  and so are its post-accumulate-grad hooks (``register_post_accumulate_grad_hook``; a ``register_hook``
  hook, which could never fire, is refused by ``fully_shard``);
* an optimizer built before ``fully_shard`` is retargeted at its first ``step()`` (the ``Retarget`` stage of
  ``perparam.runtime.optim``, run by torch's global step pre-hook, which ``record`` installs at the first
  ``fully_shard`` of the process, never at import): it trains exactly like an optimizer built after; one
  that already holds state for a replaced parameter is refused with ``ReplacedParameterError``;
* the steps of every optimizer holding perparam parameters are counted on the parameters it holds
  (``ShardedParam.optimizer_steps``, the ``CountStep`` stage of that optimizer alone), so parameters kept
  gathered across steps (``set_reshard_after_backward(False)``) are all-gathered afresh after one; other
  models' optimizers, and other ranks' when ranks are threads of one process, never make them stale;
* an optimizer that flattens each gradient (``torch.optim.LBFGS``) is refused at its first step when it holds
  a parameter whose DTensor cannot be flattened (``UnflattenableShardError``, ``optim/retarget.py``);
* a parameter assigned after ``fully_shard`` (``module.weight = nn.Parameter(...)``) is refused with a
  clear error at the next forward or unshard (``ShardedParam.register``), instead of being silently put
  back.

References a user took before ``fully_shard`` (``w = model.weight``) still point at the old, unsharded
tensor: take them after.
"""

from __future__ import annotations

import torch

from .optim.binding import install_global_hook
from .optim.registry import REGISTRY, Replacement
from .optim.retarget import FLATTENING_OPTIMIZERS, ReplacedParameterError, UnflattenableShardError

__all__ = ["FLATTENING_OPTIMIZERS", "ReplacedParameterError", "UnflattenableShardError", "record",
           "state_dtypes"]

#: attributes nn.Parameter / DTensor keep in ``__dict__`` themselves: never copied
_INTERNAL = frozenset({"_is_param", "_local_tensor", "_spec"})


def record(original: torch.Tensor, owner, call: str) -> None:
    """Remember that ``owner.sharded`` (``owner``: a ``ShardedParam``) replaced ``original`` in the
    ``fully_shard`` call over ``call`` (the modules' names) and copy the user's attributes onto it, and its
    post-accumulate-grad hooks: the same dict, so a handle taken before ``fully_shard`` still removes the
    hook (perparam runs them on the sharded parameter after each reduction, ``IterationContext``)."""
    sharded = owner.sharded
    for key, value in original.__dict__.items():
        if key not in _INTERNAL and key not in sharded.__dict__:
            sharded.__dict__[key] = value
    if original._post_accumulate_grad_hooks:
        sharded._post_accumulate_grad_hooks = original._post_accumulate_grad_hooks
    REGISTRY.replaced[original] = Replacement(sharded, call, owner.fqn)
    REGISTRY.generation += 1
    install_global_hook()


def state_dtypes(sp) -> list[tuple[str, str, torch.dtype]]:
    """``(optimizer class, state key, dtype)`` of each floating-point state tensor of the parameter's shape
    (``exp_avg``, ``momentum_buffer``, ...) that an optimizer holding ``sp`` (one that has stepped) keeps for
    it: what a cast of the parameters (``perparam.runtime.recast``) leaves in its dtype."""
    out = []
    for optimizer, binding in list(REGISTRY.bindings.items()):
        if sp not in binding.held:
            continue
        for key, value in optimizer.state.get(sp.sharded, {}).items():
            if (isinstance(value, torch.Tensor) and value.is_floating_point()
                    and tuple(value.shape) == tuple(sp.sharded.shape)):
                out.append((type(optimizer).__name__, key, value.dtype))
    return out
