"""The one registry of what perparam knows about the process's optimizers and the parameters ``fully_shard``
replaced; all of it weak, so nothing here keeps an optimizer, a parameter or a model alive.

``REGISTRY`` is the one module-level object: torch's global optimizer step pre-hook (the only way to find an
optimizer built before ``fully_shard``) is process-wide, so what it reads is too. Everything about one
optimizer is its ``Binding`` (``binding.py``), the value of ``REGISTRY.bindings`` keyed by the optimizer.
A leaf: it imports nothing of perparam, so the step's parts (``owner_step``, ``owner_state``) can ask it for
an optimizer's plan without an import circle.
"""

from __future__ import annotations

import threading
import weakref
from typing import NamedTuple

from torch.utils.weak import WeakIdKeyDictionary


class Replacement(NamedTuple):
    """What replaced an original parameter: ``sharded``, the sharded parameter; ``call`` and ``fqn``, the
    ``fully_shard`` call (its modules' names) and the parameter's name in it."""

    sharded: object
    call: str
    fqn: str


class Registry:
    """``bindings``: optimizer -> its ``Binding`` (weak on the optimizer); ``replaced``: original parameter
    -> its ``Replacement`` (weak on the original: its memory is not kept; a parameter still registered in a
    later ``fully_shard`` call, tied across calls, is refused by it, an optimizer holding it is retargeted);
    ``generation``: ``fully_shard`` replacements recorded so far (an
    optimizer checked at an older one is checked again); ``hook``: the global step pre-hook's handle, once
    the first ``fully_shard`` installed it (nothing at import)."""

    def __init__(self) -> None:
        self.bindings: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.replaced: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.generation = 0
        self.hook = None
        self._thread = threading.local()  # per thread (ranks may be threads): root forwards begun

    def forward_began(self) -> None:
        """A root forward of a sharded model began on this thread: an optimizer step left open by this
        thread (its step proper raised, so its post-hook never ran) is over (``Binding.nested``)."""
        self._thread.forwards = self.forwards() + 1

    def forwards(self) -> int:
        """Root forwards begun on this thread."""
        return getattr(self._thread, "forwards", 0)


REGISTRY = Registry()


def binding_of(optimizer):
    """``optimizer``'s ``Binding`` (``None``: it never stepped since perparam sharded something)."""
    return REGISTRY.bindings.get(optimizer)


def routing(optimizer):
    """``optimizer``'s owner plan (``owner_step.Routing``; ``None``: it holds no ``update="owner"``
    parameter)."""
    binding = REGISTRY.bindings.get(optimizer)
    return None if binding is None else binding.route
