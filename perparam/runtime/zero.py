"""ZeRO stages 1 and 2 (``ParamPolicy.zero_stage``): when a parameter's kept unsharded copy is refreshed.

A stage-1/2 parameter keeps its unsharded buffer (``ShardedParam.unsharded``, ``param_dtype``, padded) on
every rank across steps: a group's ``free`` leaves it alone and forward and backward gather nothing for it.
After the shards change it is refreshed, in the group's next all-gather (lazily: the next pre-forward,
prefetch or ``unshard()``), together with whatever stage-3 parameters that all-gather carries. The shards
change at:

* an optimizer step: ``ShardedParam.optimizer_steps`` counts the steps of the ``torch.optim`` optimizers
  holding the parameter (``perparam.runtime.adopt``: one post-hook each), a count every rank shares. A parameter
  frozen when gathered and frozen now is not refreshed after a step (the optimizer skips it);
* a load (``perparam.checkpoint.load``, ``load_full_state_dict``, ``load_state_dict``) or a device change
  (``to_empty``, ``.to(device)``): these call ``invalidate()``, which every rank calls alike.

Tensor version counters are deliberately not consulted: they may differ between ranks (an empty shard),
and the decision must be the same on every rank, since it sets the all-gather's size. An in-place change
of a sharded parameter outside these routes (``p.mul_(0)`` under ``no_grad``) is not seen: call
``perparam.runtime.zero.invalidate()`` after it.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from .param import ShardedParam

#: default process group (one per rank, also for ranks that are threads of one process: torch's threaded
#: process group keeps one world per thread) -> its load generation. Per rank, never per process: a load on
#: one thread rank must not make a peer thread's kept copies stale (its next all-gather would then carry
#: them, a size the other ranks of that peer's group do not issue).
_GENERATIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_NO_WORLD = [0]  # before init_process_group
_lock = threading.Lock()


def _world():
    return dist.distributed_c10d._world.default_pg if dist.is_initialized() else None


def generation() -> int:
    """This rank's load generation: the number of ``invalidate()`` calls made under its default process
    group (in its thread, for thread ranks)."""
    world = _world()
    if world is None:
        return _NO_WORLD[0]
    with _lock:
        return _GENERATIONS.get(world, 0)


def invalidate() -> None:
    """Every kept unsharded copy of this rank (the parameters sharded under the calling thread's default
    process group) is stale: the next all-gather of its group refreshes it. Call it on every rank (it
    changes the size of the next all-gathers)."""
    world = _world()
    with _lock:
        if world is None:
            _NO_WORLD[0] += 1
        else:
            _GENERATIONS[world] = _GENERATIONS.get(world, 0) + 1


def needs_refresh(p: ShardedParam) -> bool:
    """``p`` (a stage-1/2 parameter) has no valid kept copy: never gathered, freed by a move, invalidated by
    a load, or a step ran since it was gathered while it was trainable (then or now)."""
    key = p.kept_key
    if key is None or not p.storage_alive or key[1] != generation():
        return True
    return key[0] != p.optimizer_steps and (key[2] or p.sharded.requires_grad)


def mark_gathered(params: list[ShardedParam]) -> None:
    """``params``' kept copies are being filled from the shards as they are now."""
    current = generation()
    for p in params:
        p.kept_key = (p.optimizer_steps, current, p.sharded.requires_grad)
