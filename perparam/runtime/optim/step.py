"""One ``optimizer.step()`` as perparam's stages see it, and the stage protocol.

A stage is one thing perparam does around a step (``stages.py``): ``before(step)`` in the pre-hook, in the
order of ``stages.STAGES``; ``after(step)`` in the post-hook, in the reverse order, for every stage whose
``before`` ran; the same ``after`` undoes a stage whose step did not complete (a later stage's ``before``
raised, or the step proper raised and the next step found it open: ``step.completed`` is then ``False``).
A stage with ``first = True`` runs in torch's global step pre-hook, before the user's own pre-hooks (they
see what it did); the others in perparam's per-optimizer pre-hook, the last one, right before the step
proper. The shape is that of FSDP2's comm objects: a small class per concern, its state on itself.
"""

from __future__ import annotations

import enum
from typing import Protocol

from .. import owner_grads


class GradKind(enum.Enum):
    """What a sharded parameter's ``.grad`` is at a step, decided once per parameter per step
    (``Step.kind``)."""

    NONE = "none"  # no gradient: no rank used the parameter
    HELD = "held"  # reduced straight to its owner (``owner_grads``): whole there, NaN rows elsewhere
    OWN = "own"  # perparam's reduce-scattered (or stage-1 whole) gradient, changed in place or not
    OTHER = "other"  # assigned by the user, or a DTensor op's result


class Step:
    """One step of ``optimizer``: ``closure`` (``step(closure)`` computes the gradients inside the step),
    ``completed`` (set when the step proper returned: the post-hook ran), and each held parameter's
    gradient kind, asked of the gradient once."""

    __slots__ = ("closure", "completed", "optimizer", "_kinds")

    def __init__(self, optimizer, closure: bool) -> None:
        self.optimizer, self.closure, self.completed = optimizer, closure, False
        self._kinds: dict[int, GradKind] = {}

    def kind(self, sp) -> GradKind:
        """``sp``'s gradient kind at this step (the first answer, kept for the step)."""
        kind = self._kinds.get(id(sp))
        if kind is None:
            grad = sp.sharded.grad
            if grad is None:
                kind = GradKind.NONE
            elif sp.policy.update == "owner" and owner_grads.at_owner(sp):  # only an owner's is reduced to it
                kind = GradKind.HELD
            elif sp.grad_is_own(grad):
                kind = GradKind.OWN
            else:
                kind = GradKind.OTHER
            self._kinds[id(sp)] = kind
        return kind


class Stage(Protocol):
    """One thing perparam does around a step; its state lives on the stage (one per ``Binding``)."""

    #: runs in torch's global pre-hook, before the user's pre-hooks, instead of right before the step proper
    first: bool

    def before(self, step: Step, binding) -> None: ...

    def after(self, step: Step, binding) -> None: ...
