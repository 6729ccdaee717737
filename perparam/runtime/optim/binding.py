"""One optimizer as perparam sees it: a ``Binding``, the value of ``REGISTRY.bindings`` keyed by the
optimizer.

It holds everything perparam keeps about that optimizer: the ``ShardedParam``s whose sharded parameters it
holds (``held``), its owner plan with the plan's staging pool (``route``), the stages of its step
(``stages``: each keeps its own records, e.g. ``LocalSwap``'s swapped parameters), the nesting test
(``depth``, ``nested``), and whether its state-dict hooks are installed. It never holds the optimizer (a
value of a ``WeakKeyDictionary`` must not, or the key never dies); torch's hooks on the optimizer hold it.

Hooks: torch's global step pre-hook (one per process, installed by the first ``fully_shard``:
``install_global_hook``) binds every stepping optimizer and runs the ``first`` stages (``Retarget``), so
the user's own pre-hooks see the sharded parameters; an optimizer found holding perparam parameters gets
one pre-hook and one post-hook of its own (``install``), which run the other stages in order and undo
them in reverse (``step.py``). perparam's pre-hook must be the optimizer's last (the user's hooks never
see the local swap): a step that finds a pre-hook registered after it runs on DTensors, and its post-hook
registers perparam's again (``handle.remove()`` then ``register_step_pre_hook``, torch's public API), so the
next step swaps again. The post-hook must be the first: torch offers no ``prepend`` for step hooks, so it
is moved to the front of the optimizer's post-hook dict once, when installed (the one write into torch's
private hook dicts; the last-pre-hook test reads the pre-hook dict).

Nesting: a subclass's ``step`` calling ``super().step()``, when the parent class's ``step`` is hooked too
(torch hooks the class of every optimizer made), runs perparam's hooks again inside the step proper; and
the owner stage runs the optimizer's own step on whole tensors inside the pre-hook (``busy``). Both inner
calls leave the step alone. A pre-hook that finds a step still open (``depth``) is nested when two classes
of the optimizer's MRO have hooked steps and no root forward began on this thread since the open step
began; otherwise the open step is one whose step proper raised (its post-hook never ran), which is undone
first.
"""

from __future__ import annotations

import contextlib
import weakref

from torch.optim.optimizer import register_optimizer_step_pre_hook

from .. import local_step, owner_state
from ..untraced import untraced
from .registry import REGISTRY
from .stages import STAGES
from .step import Step


class Binding:
    """perparam's record of one optimizer (see the module docstring)."""

    def __init__(self) -> None:
        self.held: weakref.WeakSet = weakref.WeakSet()  # ShardedParams whose sharded parameters it holds
        self.route = None  # owner_step.Routing of its update="owner" parameters, with its staging pool
        self.stages = [stage() for stage in STAGES]
        self.firsts = [stage for stage in self.stages if stage.first]  # run by torch's global pre-hook
        self.entered: list = []  # the stages whose ``before`` ran in the open step, in order
        self.step: Step | None = None  # the open step
        self.depth = 0  # hooked step calls open: 1 the outermost, more when nested
        self.opened_at = 0  # REGISTRY.forwards() when the open step began
        self.busy = False  # the owner stage runs the optimizer's own step on whole tensors
        self.pre_handle = self.post_handle = None  # perparam's step hooks on the optimizer, once installed
        self.state_hooks = False  # its state_dict()/load_state_dict() convert owner state (owner_state)
        self.mixed_watched = False  # mixed_step's hooks name its step's DTensor mix error (not torch's own)
        self.mixed_catch = None  # mixed_step's mode, entered for the step in progress

    def first(self, optimizer) -> None:
        """torch's global pre-hook: the ``first`` stages, before the user's pre-hooks."""
        step = Step(optimizer, False)
        for stage in self.firsts:
            stage.before(step, self)

    def install(self, optimizer) -> None:
        """perparam's pre-hook and post-hook on ``optimizer`` (once), and its state-dict hooks once it routes
        owner parameters."""
        if self.route is not None and not self.state_hooks:
            owner_state.install(optimizer)
            self.state_hooks = True
        if self.pre_handle is None and self.held:
            # eager also inside torch.compile(optimizer.step): perparam's bookkeeping is no graph code
            self.pre_handle = optimizer.register_step_pre_hook(untraced(self.pre))
            self.post_handle = optimizer.register_step_post_hook(untraced(self.post))
            optimizer._optimizer_step_post_hooks.move_to_end(self.post_handle.id, last=False)

    def pre(self, optimizer, args, kwargs) -> None:
        if self.busy:
            return
        if self.depth:
            if self.nested(optimizer):
                self.depth += 1
                return
            self.close()  # the last step's step proper raised: put things back first
        step = Step(optimizer, local_step.has_closure(args, kwargs), self.held)
        self.step, self.depth, self.opened_at = step, 1, REGISTRY.forwards()
        try:
            for stage in self.stages:
                if not stage.first:
                    stage.before(step, self)
                    self.entered.append(stage)
        except BaseException:
            step.forget()
            self.close()
            raise
        step.forget()  # the gradients read for the stages: not kept through the step proper

    def post(self, optimizer, args, kwargs) -> None:
        if self.busy:
            return
        if self.depth > 1:
            self.depth -= 1
            return
        if self.step is not None:
            self.step.completed = True
        self.close()
        if not self.last_pre_hook(optimizer):  # registered last again, for the next step (public API)
            self.pre_handle.remove()
            self.pre_handle = optimizer.register_step_pre_hook(untraced(self.pre))

    def close(self) -> None:
        """Run ``after`` of the open step's entered stages, in reverse order."""
        step, entered = self.step, self.entered
        self.step, self.entered, self.depth = None, [], 0
        for stage in reversed(entered):
            stage.after(step, self)

    def nested(self, optimizer) -> bool:
        """Whether a pre-hook finding a step open runs inside it (see the module docstring)."""
        return self.opened_at == REGISTRY.forwards() and _hooked_steps(type(optimizer)) > 1

    def last_pre_hook(self, optimizer) -> bool:
        """Whether perparam's pre-hook is the optimizer's last."""
        hooks = optimizer._optimizer_step_pre_hooks
        return self.pre_handle is None or not hooks or next(reversed(hooks)) == self.pre_handle.id

    @contextlib.contextmanager
    def stepping_whole(self):
        """While the owner stage runs the optimizer's own step: perparam's hooks leave it alone."""
        self.busy = True
        try:
            yield
        finally:
            self.busy = False


def _hooked_steps(cls: type) -> int:
    """Classes of ``cls``'s MRO whose own ``step`` torch has hooked (``Optimizer._patch_step_function``)."""
    return sum(1 for c in cls.__mro__ if getattr(vars(c).get("step"), "hooked", False))


def bind(optimizer) -> Binding:
    """``optimizer``'s binding, made at its first step, with its ``first`` stages run (its parameters
    retargeted and checked, its owners planned): what torch's global pre-hook does."""
    binding = REGISTRY.bindings.get(optimizer)
    if binding is None:
        binding = REGISTRY.bindings[optimizer] = Binding()
    binding.first(optimizer)
    return binding


def _global_pre_hook(optimizer, args, kwargs) -> None:
    binding = REGISTRY.bindings.get(optimizer)  # (``bind`` inline: it runs at every step of every optimizer)
    if binding is None:
        binding = REGISTRY.bindings[optimizer] = Binding()
    binding.first(optimizer)


def install_global_hook() -> None:
    """torch's global optimizer step pre-hook, registered once, by the first ``fully_shard`` (not at
    import)."""
    if REGISTRY.hook is None:
        # eager in a compiled step too
        REGISTRY.hook = register_optimizer_step_pre_hook(untraced(_global_pre_hook))
