"""The stages of an optimizer step, in order (``STAGES``); ``step.py`` has the protocol.

``before`` runs in this order, ``after`` in the reverse: the local swap is undone first, then the routed
parameters are put back, then the step is counted. A new stage is one class here and one entry in
``STAGES`` (where it goes in the order is what it may rely on: a stage sees what the stages before it did).
"""

from __future__ import annotations

from .. import local_step, owner_step
from .retarget import Retarget


class CountStep:
    """After a completed step: the step counted on the parameters the optimizer holds
    (``ShardedParam.optimizer_steps``): storage gathered before is stale (``runtime.zero``; foreach updates
    bump no DTensor version counter). A frozen parameter holding a ``.grad`` was stepped too (torch's
    optimizers step every parameter with a gradient), so its stage-1/2 kept copy is marked stale outright:
    ``runtime.zero.needs_refresh`` skips a parameter frozen when gathered and frozen now. Whether it holds a
    ``.grad`` is the same on every rank."""

    first = False

    def before(self, step, binding) -> None:
        return None

    def after(self, step, binding) -> None:
        if not step.completed:
            return
        for sp in binding.held:
            sp.optimizer_steps += 1
            if sp.kept:
                sharded = sp.sharded
                if not sharded.requires_grad and sharded.grad is not None:
                    sp.kept_key = None


class OwnerRoute:
    """``update="owner"`` parameters stepped whole on their owners before the step proper, and left out of
    ``param_groups`` for it (``owner_step.step_in``); put back after (``groups``: what to put back)."""

    first = False

    def __init__(self) -> None:
        self.groups = None

    def before(self, step, binding) -> None:
        if binding.route is not None:
            self.groups = owner_step.step_in(step.optimizer, binding.route, step, binding.stepping_whole)

    def after(self, step, binding) -> None:
        groups, self.groups = self.groups, None
        if groups is not None:
            owner_step.step_out(groups)


class LocalSwap:
    """SGD/Adam/AdamW on the local shards (``local_step``): swapped in last, out first (``records``: what
    to swap back). A step that finds a pre-hook registered after perparam's runs on DTensors."""

    first = False

    def __init__(self) -> None:
        self.records = None

    def before(self, step, binding) -> None:
        optimizer = step.optimizer
        if (type(optimizer) in local_step.ELEMENTWISE and not step.closure
            and binding.last_pre_hook(optimizer)):
            self.records = local_step.swap_in(optimizer, binding.held, step)

    def after(self, step, binding) -> None:
        records, self.records = self.records, None
        local_step.swap_out(step.optimizer, records)


#: the step's stages, in the order their ``before`` runs
STAGES = (CountStep, Retarget, OwnerRoute, LocalSwap)
