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
    ``completed`` (set when the step proper returned: the post-hook ran), and, for each parameter of ``held``
    (the ``ShardedParam``s the optimizer holds), its ``.grad`` and that gradient's kind, read and decided
    once for the step (``grads``)."""

    __slots__ = ("closure", "completed", "held", "optimizer", "_grads")

    def __init__(self, optimizer, closure: bool, held=()) -> None:
        self.optimizer, self.closure, self.completed, self.held = optimizer, closure, False, held
        self._grads: dict | None = None

    def grads(self) -> dict:
        """id(``ShardedParam``) -> (its sharded ``.grad``, ``GradKind``) for every parameter of ``held``: each
        ``.grad`` read once and its kind decided once, in one pass at the first call (kept for the step)."""
        grads = self._grads
        if grads is None:
            grads = self._grads = {}
            for sp in self.held:
                grad = sp.sharded.grad
                if grad is None:
                    kind = GradKind.NONE
                elif sp.policy.update == "owner" and owner_grads.at_owner(sp, grad):  # only an owner's can be
                    kind = GradKind.HELD
                elif sp.grad_is_own(grad):
                    kind = GradKind.OWN
                else:
                    kind = GradKind.OTHER
                grads[id(sp)] = (grad, kind)
        return grads

    def kind(self, sp) -> GradKind:
        """``sp``'s gradient kind at this step (``sp`` one of ``held``)."""
        return self.grads()[id(sp)][1]

    def forget(self) -> None:
        """Drop the gradients read (once the stages' ``before`` ran: the step proper may free them)."""
        self._grads = None


class Stage(Protocol):
    """One thing perparam does around a step; its state lives on the stage (one per ``Binding``)."""

    #: runs in torch's global pre-hook, before the user's pre-hooks, instead of right before the step proper
    first: bool

    def before(self, step: Step, binding) -> None: ...

    def after(self, step: Step, binding) -> None: ...
