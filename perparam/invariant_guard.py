"""What ``perparam.InvariantUnits`` refuses while its mode is on: gradients it would not count.

The mode counts a gradient only when it is taken into the tree at the end of ``with iu.unit(u, step):``.
A backward that reaches a sharded module outside a unit (after leaving the ``with``, an extra loss between
the units and ``iu.reduce()``, or after it) would otherwise be lost, dropped, or divided by U instead of
K (issue 44: 1.25, 3.5 and 4.0 where one process gives 3.5, 4.5 and 4.5); an optimizer step with units
run and not reduced would step on nothing and be reported one unit later.

``gate`` is each group's ``grad_gate`` (``perparam.runtime.hooks`` calls it before a backward reaches the
group issues anything): outside a unit it records the refusal and raises ``InvariantError`` on this rank at
once, before any collective of that backward. Every rank calls ``iu.reduce()``: there the ranks agree
(one all-reduce of a flag, every rank, then ``agreed``) so a refusal seen on some ranks only is raised on all.
A step pre-hook on every optimizer refuses a step that holds the mode's parameters while units are run
and not reduced, or after a refusal.
"""

from __future__ import annotations

import weakref

import torch

_LIVE: weakref.WeakSet = weakref.WeakSet()  # the InvariantUnits in their mode (the step hook's view)
#: the step pre-hook's handle (installed by the first InvariantUnits) and the error type the refusals raise
#: (``perparam.InvariantError``, which lives in invariant.py, given by ``install``)
_STATE: dict = {"hook": None, "error": ValueError}


def install(iu, error: type[Exception]) -> None:
    """Turn the refusals on for ``iu`` (at ``InvariantUnits(...)``): each group's gate, the step hook;
    ``error``: the type they raise."""
    _STATE["error"] = error
    for g in iu.groups:
        g.grad_gate = iu._gate
    _LIVE.add(iu)
    if _STATE["hook"] is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _STATE["hook"] = register_optimizer_step_pre_hook(_before_step)


def uninstall(iu) -> None:
    """Off again (``iu.close()``)."""
    for g in iu.groups:
        if g.grad_gate == iu._gate:
            g.grad_gate = None
    _LIVE.discard(iu)


def outside_unit(iu, group) -> str:
    """The message of a gradient that reached ``group`` outside a unit."""
    where = ("after iu.reduce() (it would be divided by units=U, not reduced with the units)" if iu._reduced
             else "after leaving the last `with iu.unit(u, step):`, before iu.reduce() (it would be dropped)"
            if iu._done() == len(iu.indices)
             else "after leaving `with iu.unit(u, step):` (the next unit would drop it)")
    return (f"InvariantUnits: a gradient reached sharded module '{group.path or group.name}' outside a unit, "
            f"{where}; the mode counts only gradients of a backward run inside `with iu.unit(u, step):`: run "
            "each unit's forward and backward inside it (add an extra loss to the unit's loss), or "
            "iu.close() before a plain backward")


def agreed(iu, flag: torch.Tensor) -> None:
    """Every rank, in ``iu.reduce()``, once ``flag`` (this rank's refusal, 1 or 0) is summed over the mode's
    ranks: raises ``InvariantError`` on every rank when any rank refused a gradient in this step."""
    if flag.item():
        message = iu._refused or ("InvariantUnits.reduce: another rank refused a gradient outside a unit in "
                                  "this step (its error names the module); this step is given up on every "
                                  "rank")
        iu._refused = None
        iu._abandon()
        raise _STATE["error"](message)


def _before_step(optimizer, args, kwargs) -> None:
    for iu in list(_LIVE):
        held = iu._sharded_ids
        if not any(id(p) in held for group in optimizer.param_groups for p in group["params"]):
            continue
        if iu._refused:
            raise _STATE["error"](f"{type(optimizer).__name__}.step refused: {iu._refused}")
        if iu._done():
            raise _STATE["error"](f"InvariantUnits: {type(optimizer).__name__}.step with {iu._done()} units "
                                 "run and not reduced (the step would not see their gradients); call "
                                 "iu.reduce() after the last unit and before the step")
